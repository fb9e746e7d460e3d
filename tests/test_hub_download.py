"""Hub ids download through huggingface_hub: the real path, against a fake hub on loopback.

Each run is a fresh process with HF_ENDPOINT pointing at `FakeHub` and its own cache folder,
as a user's would be: the first run downloads (with a progress bar), a later run works with the
hub gone, and every failure is one line naming its cause.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from minisgl import LLM, SamplingParams
from minisgl.distributed import free_loopback_addr
from tests.conftest import build_tiny_checkpoint, qwen3_tokenizer_dir
from tests.fake_hub import FakeHub, FakeRepo

REPO = "minisgl-test/tiny-llama"
GATED_REPO = "minisgl-test/gated"
BIN_ONLY_REPO = "minisgl-test/bin-only"
TOKEN = "hf_test_token"
PROMPT = [1, 2, 3, 4, 5]
NEW_TOKENS = 6
SHARD_SIZE = "300KB"  # a few shards plus an index, so the index path downloads too
RUN_TIMEOUT_S = 120.0
WAIT_STEP_S = 0.05
OBSERVE_TIMEOUT_S = 60.0
# Files a serving run must never download: other weight formats, docs, subfolders.
NEVER_FETCHED = ("pytorch_model.bin", "README.md", "original/consolidated.safetensors")

# One process = one user run: serve REPO through LLM and print what it generated.
LLM_RUN = textwrap.dedent(f"""
    import json, sys
    from minisgl import LLM, SamplingParams
    llm = LLM(sys.argv[1], dtype="float32", num_pages=64, max_running_requests=2)
    out = llm.generate([{PROMPT}], SamplingParams(temperature=0, max_tokens={NEW_TOKENS},
                                                 ignore_eos=True))[0]
    print(json.dumps({{"path": str(llm.scheduler.engine.model_path), "tokens": out.token_ids}}))
    llm.shutdown()
""")
# Resolution alone (what every tp rank and the launcher do first), with INFO logs.
RESOLVE_RUN = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    from minisgl.config import ServerArgs
    from minisgl.models.resolve import resolve_model_path_for
    offline = "--offline" in sys.argv
    args = ServerArgs(model=sys.argv[1], download_dir=sys.argv[2], offline=offline)
    print(resolve_model_path_for(args))
""")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny Llama, sharded with an index, with the Qwen3 tokenizer files."""
    root = tmp_path_factory.mktemp("hub")
    single = build_tiny_checkpoint(
        root / "single", "llama", vocab_size=1024, bos_token_id=1, eos_token_id=2
    )
    sharded = root / "sharded"
    hf = AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    hf.save_pretrained(sharded, max_shard_size=SHARD_SIZE)
    for f in qwen3_tokenizer_dir().iterdir():
        (sharded / f.name).write_bytes(f.read_bytes())
    assert len(list(sharded.glob("*.safetensors"))) > 1
    return sharded


def _repos(checkpoint: Path) -> dict[str, FakeRepo]:
    main = FakeRepo.from_folder(checkpoint)
    for name in NEVER_FETCHED:
        main.files[name] = b"not for serving"
    no_weights = {n: b for n, b in main.files.items() if not n.endswith(".safetensors")}
    no_weights.pop("model.safetensors.index.json")
    return {
        REPO: main,
        GATED_REPO: FakeRepo.from_folder(checkpoint, gated_token=TOKEN),
        BIN_ONLY_REPO: FakeRepo(files=no_weights),
    }


def _env(endpoint: str, home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_TOKEN")}
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HOME=str(home),
        HF_HUB_CACHE=str(home / "hub"),
        PYTHONPATH=os.getcwd(),
        **extra,
    )
    return env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )


def _server_error(args: list[str], env: dict[str, str]) -> str:
    """Start the server CLI expecting a start-up failure; return its one error line."""
    proc = _run(["-m", "minisgl.server", *args], env)
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "server failed to start" in line]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_download_then_cache_then_offline(checkpoint: Path, tmp_path: Path) -> None:
    with LLM(str(checkpoint), dtype="float32", num_pages=64, max_running_requests=2) as llm:
        sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        expected = llm.generate([PROMPT], sp)[0].token_ids

    script = tmp_path / "llm_run.py"
    script.write_text(LLM_RUN)
    home = tmp_path / "home"
    hub = FakeHub(_repos(checkpoint)).start()
    gone_url = hub.url  # nothing listens there once the hub stops
    try:
        first = _run([str(script), REPO], _env(hub.url, home))
        assert first.returncode == 0, first.stderr
        downloaded = list(hub.requests)
        # A later start, hub up: one question (which commit is main?), no file requests.
        cached = _run(["-c", RESOLVE_RUN, REPO, str(home / "hub")], _env(hub.url, home))
        assert cached.returncode == 0, cached.stderr
        later = hub.requests[len(downloaded) :]
        assert [p for _, p in later if "/resolve/" in p] == []
        assert [p for _, p in later if "/api/models/" in p] == [f"/api/models/{REPO}/revision/main"]
    finally:
        hub.stop()
    result = json.loads(first.stdout.strip().splitlines()[-1])
    assert cached.stdout.strip().splitlines()[-1] == result["path"]
    assert result["tokens"] == expected
    assert Path(result["path"]).is_relative_to(home / "hub")
    assert "Fetching" in first.stderr and "100%" in first.stderr  # the progress bar
    for f in checkpoint.iterdir():  # every file once (tokenizer, config, index, shards)
        assert hub.file_gets(f.name) == 1, f.name
    for name in NEVER_FETCHED:
        assert hub.file_gets(name) == 0 and hub.count("HEAD", name) == 0, name

    # The hub is gone: the cached copy serves, online mode and --offline alike.
    again = _run([str(script), REPO], _env(gone_url, home))
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.strip().splitlines()[-1]) == result
    offline = _run(["-c", RESOLVE_RUN, REPO, str(home / "hub"), "--offline"], _env(gone_url, home))
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout.strip().splitlines()[-1] == result["path"]

    # An empty cache and no downloads: one line naming the cause, from --offline or the env.
    empty = tmp_path / "empty"
    line = _server_error(["--model", REPO, "--offline"], _env(gone_url, empty))
    assert f"model '{REPO}' (revision main) is not in the local Hugging Face cache" in line
    assert "(--offline)" in line
    line = _server_error(["--model", REPO], _env(gone_url, empty, HF_HUB_OFFLINE="1"))
    assert "(HF_HUB_OFFLINE=1)" in line


def test_hub_errors_are_one_line(checkpoint: Path, tmp_path: Path) -> None:
    with FakeHub(_repos(checkpoint)) as hub:
        env = _env(hub.url, tmp_path / "home")
        cases = {
            "minisgl-test/no-such-model": f"model 'minisgl-test/no-such-model' not found on the "
            f"hub ({hub.url})",
            GATED_REPO: f"model '{GATED_REPO}' is gated on the hub",
            BIN_ONLY_REPO: f"model '{BIN_ONLY_REPO}' (revision 0123456789ab) has no "
            "*.safetensors weights",
        }
        for model, message in cases.items():
            assert message in _server_error(["--model", model], env), model
        line = _server_error(["--model", REPO, "--revision", "v9"], env)
        assert f"model '{REPO}' has no revision 'v9'" in line
        # A token of an account without access is refused too (403, not 401).
        line = _server_error(["--model", GATED_REPO], {**env, "HF_TOKEN": "hf_other"})
        assert "is gated" in line

        # HF_TOKEN opens the gated repo; --download-dir puts it where asked.
        download_dir = tmp_path / "models"
        proc = _run(["-c", RESOLVE_RUN, GATED_REPO, str(download_dir)], {**env, "HF_TOKEN": TOKEN})
        assert proc.returncode == 0, proc.stderr
        folder = Path(proc.stdout.strip().splitlines()[-1])
        assert folder.is_relative_to(download_dir) and (folder / "config.json").exists()

    unreachable = f"http://{free_loopback_addr()}"  # nothing listens there
    line = _server_error(["--model", REPO], _env(unreachable, tmp_path / "home2"))
    assert f"cannot reach the Hugging Face hub at {unreachable}" in line
    assert f"model '{REPO}' (revision main) is not fully in the local cache" in line


def test_one_process_downloads_the_others_wait(checkpoint: Path, tmp_path: Path) -> None:
    download_dir = tmp_path / "models"
    with FakeHub(_repos(checkpoint)) as hub:
        hub.release_downloads.clear()  # file downloads hang until the test lets them go
        env = _env(hub.url, tmp_path / "home")
        args = [sys.executable, "-c", RESOLVE_RUN, REPO, str(download_dir)]
        logs = [tmp_path / "first.log", tmp_path / "second.log"]
        procs = []
        try:
            with logs[0].open("w") as log:
                procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=log))
            _wait_for(lambda: hub.count("GET", "/resolve/") > 0, "the first download to start")
            with logs[1].open("w") as log:
                procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=log))
            _wait_for(
                lambda: "another process is downloading" in logs[1].read_text(),
                "the second process to wait",
            )
            hub.release_downloads.set()
            outs = [p.communicate(timeout=RUN_TIMEOUT_S)[0].decode().strip() for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        assert [p.returncode for p in procs] == [0, 0], [log.read_text() for log in logs]
        assert outs[0] == outs[1] and outs[0].startswith(str(download_dir))
        # The waiter read the cache: it sent the hub nothing at all.
        assert hub.count("GET", "/revision/") == 1
        assert all(hub.file_gets(f.name) == 1 for f in checkpoint.iterdir())


def _wait_for(condition, what: str) -> None:
    deadline_s = time.monotonic() + OBSERVE_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline_s, f"timed out waiting for {what}"
        time.sleep(WAIT_STEP_S)
