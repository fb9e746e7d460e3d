"""The peer check's driver and runners on CPU (benchmark/offline/peer.py): the workload is
bench.py's, the flags reach the children, the table's ratio, our runner end to end on a tiny
model, and the peer runner's import isolation against a stand-in Mini-SGLang package (its
package is also named `minisgl`; the real one needs CUDA and runs in scripts/peer_check.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OFFLINE = ROOT / "benchmark" / "offline"
sys.path.insert(0, str(OFFLINE))  # bench.py and peer.py are scripts, not a package
import bench  # noqa: E402
import peer  # noqa: E402

TINY = [
    "--num-requests=3",
    "--min-input-len=8",
    "--max-input-len=16",
    "--min-output-len=3",
    "--max-output-len=5",
]
# Ours on CPU: no FlashInfer, no graphs; a small pool for the tiny model.
CPU_OURS = [
    "--attention-backend=auto",
    "--overlap=auto",
    "--cuda-graphs=default",
    "--page-size=1",
    "--num-pages=512",
]
RUN_TIMEOUT_S = 240

# A stand-in for Mini-SGLang's source tree: python/minisgl is a namespace package (no
# __init__.py) like theirs, with the three modules the runner uses. Its LLM records where it
# was imported from and what sys.path held, and answers each request with max_tokens tokens.
FAKE_CORE = """
from dataclasses import dataclass

@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    ignore_eos: bool = False
    max_tokens: int = 1024
"""
FAKE_ENV = """
class _Env:
    DISABLE_OVERLAP_SCHEDULING = False

ENV = _Env()
"""
FAKE_LLM = """
import json, os, sys

class LLM:
    prefill_budget = 8192

    def __init__(self, model_path, **kwargs):
        record = {"file": __file__, "sys_path": sys.path, "model": model_path, "kwargs": kwargs}
        with open(os.environ["FAKE_PEER_RECORD"], "w") as f:
            json.dump(record, f)
        self.calls = []

    def generate(self, prompts, sampling_params):
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        self.calls.append(len(prompts))
        return [{"text": "", "token_ids": [7] * sp.max_tokens} for sp in sampling_params]

    def shutdown(self):
        pass
"""


def make_fake_peer(root: Path) -> Path:
    package = root / "python" / "minisgl"
    (package / "llm").mkdir(parents=True)
    (package / "core.py").write_text(textwrap.dedent(FAKE_CORE))
    (package / "env.py").write_text(textwrap.dedent(FAKE_ENV))
    (package / "llm" / "__init__.py").write_text(textwrap.dedent(FAKE_LLM))
    return root


def args_for(*argv: str) -> list[str]:
    return ["--compare", "--model=/nonexistent", *argv]


def test_workload_is_bench_py_s(tiny_qwen3):
    args = peer.parse_args(["--engine=minisgl", f"--model={tiny_qwen3}", *TINY, "--seed=3"])
    prompts, output_lens = peer.build_workload(args)
    flags = [f"--model={tiny_qwen3}", *TINY, "--seed=3"]
    expected = bench.build_workload(bench.parse_args(flags))
    assert (prompts, output_lens) == (expected.prompts, expected.output_lens)
    assert all(8 <= len(p) <= 16 for p in prompts) and all(3 <= n <= 5 for n in output_lens)
    other = peer.build_workload(
        peer.parse_args(["--engine=minisgl", f"--model={tiny_qwen3}", *TINY])
    )
    assert other[0] != prompts  # the seed reaches the generator
    digest = peer.workload_digest(prompts, output_lens)
    assert digest != peer.workload_digest(*other)


def test_defaults_are_mini_sglang_s_workload_and_our_best_config():
    args = peer.parse_args(args_for())
    workload = (args.num_requests, args.min_input_len, args.max_input_len)
    assert workload + (args.min_output_len, args.max_output_len) == (256, 100, 1024, 100, 1024)
    assert (args.attention_backend, args.overlap, args.cuda_graphs) == ("flashinfer", "on", "on")
    assert peer.peer_options(args) == {
        "attention_backend": "fi",
        "page_size": 256,
        "max_extend_tokens": 16384,
        "max_seq_len_override": 4096,
    }
    assert args.engines.split(",") == ["minisgl", "mini-sglang"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--model=m"],  # neither --engine nor --compare
        ["--compare", "--engine=minisgl", "--model=m"],
        ["--compare"],  # no --model
        args_for("--engines=minisgl,vllm"),
        args_for("--min-input-len=10", "--max-input-len=9"),
    ],
)
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        peer.parse_args(argv)


def test_children_get_the_driver_s_settings(tmp_path):
    args = peer.parse_args(
        args_for(*TINY, "--seed=5", "--max-prefill-tokens=4096", "--peer-page-size=1")
    )
    for engine in peer.ENGINES:
        argv = peer.child_argv(args, engine, tmp_path / "r.json", tmp_path / "w.json")
        assert argv[0] == str(OFFLINE / "peer.py")
        child = peer.parse_args(argv[1:])
        assert child.engine == engine and child.workload_file == str(tmp_path / "w.json")
        for name in ("num_requests", "max_output_len", "seed", "max_prefill_tokens", "model"):
            assert getattr(child, name) == getattr(args, name), name
        assert peer.peer_options(child) == peer.peer_options(args)
        assert peer.bench_argv(child) == peer.bench_argv(args)


def test_child_environments(tmp_path):
    fake = make_fake_peer(tmp_path / "peer")
    elsewhere = tmp_path / "site"
    (elsewhere / "minisgl").mkdir(parents=True)  # e.g. an installed copy of either package
    plain = tmp_path / "plain"
    plain.mkdir()
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(elsewhere), str(plain)]), "X": "1"}
    theirs = peer.child_env("mini-sglang", fake, env)["PYTHONPATH"].split(os.pathsep)
    assert theirs == [str(fake / "python"), str(plain)]
    ours = peer.child_env("minisgl", fake, env)
    assert ours["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT) and ours["X"] == "1"


def test_table_ratio_and_failures():
    results = [
        {"engine": "mini-sglang", "settings": "fi", "seconds": 20.0, "output_tok_s": 1000.0},
        {"engine": "minisgl", "settings": "flashinfer", "seconds": 8.0, "output_tok_s": 2500.0},
    ]
    header, _, theirs, ours = peer.table(results)
    assert header.split() == ["engine", "settings", "seconds", "out", "tok/s", "ratio"]
    assert theirs.split() == ["mini-sglang", "fi", "20.00", "1000", "1.00"]
    assert ours.split() == ["minisgl", "flashinfer", "8.00", "2500", "2.50"]
    failed = {"engine": "mini-sglang", "settings": "FAILED (exit 1)", "seconds": None}
    _, _, theirs, ours = peer.table([failed, results[1]])
    assert theirs.split()[-3:] == ["-", "-", "-"] and ours.split()[-1] == "-"


def test_driver_flags_another_workload(monkeypatch, capsys):
    prompts, output_lens = [[1, 2, 3], [4, 5]], [2, 3]
    monkeypatch.setattr(peer, "build_workload", lambda args: (prompts, output_lens))

    def fake_child(args, engine, tmp, workload, timeout_s):
        assert peer.read_workload(str(workload)) == (prompts, output_lens)
        lens = output_lens if engine == "minisgl" else [3, 3]
        return peer.result(engine, engine, 0.5, prompts, lens)

    monkeypatch.setattr(peer, "run_child", fake_child)
    results = peer.compare(peer.parse_args(args_for()))
    assert [r["engine"] for r in results] == ["minisgl", "mini-sglang"]
    last = capsys.readouterr().out.strip().splitlines()
    assert last[-1].split()[:2] == ["mini-sglang", "mini-sglang"] and "OTHER WORKLOAD" in last[-1]
    assert "OTHER WORKLOAD" not in last[-2] and last[-2].split()[-1] == "0.83"  # 10/0.5 vs 12/0.5


def test_driver_starts_no_child_past_its_budget(monkeypatch, capsys):
    monkeypatch.setattr(peer, "build_workload", lambda args: ([[1, 2]], [2]))
    results = peer.compare(peer.parse_args(args_for("--budget-s=10")))
    assert [r["settings"] for r in results] == ["SKIPPED (no time left)"] * 2
    assert capsys.readouterr().out.strip().splitlines()[-1].split()[-3:] == ["-", "-", "-"]


def test_peer_runner_needs_the_driver_s_workload(tmp_path):
    with pytest.raises(SystemExit, match="--workload-file"):
        peer.main(["--engine=mini-sglang", "--model=m", f"--peer-path={tmp_path}"])


def test_compare_end_to_end_with_a_stand_in_peer(tiny_qwen3, tmp_path):
    """The driver, both children and the table: ours on the tiny model, the stand-in peer
    imported from its own folder although our repository is on the driver's PYTHONPATH."""
    fake = make_fake_peer(tmp_path / "peer")
    record = tmp_path / "record.json"
    out = tmp_path / "results.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FAKE_PEER_RECORD": str(record)}
    command = [
        sys.executable, str(OFFLINE / "peer.py"), "--compare", f"--model={tiny_qwen3}",
        f"--peer-path={fake}", f"--json={out}", *TINY, *CPU_OURS,
    ]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT, env=env
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ours, theirs = json.loads(out.read_text())
    for r in (theirs, ours):
        assert r["seconds"] is not None, r["settings"] + done.stdout[-3000:] + done.stderr[-3000:]
    # Both ran the driver's workload, counted in full.
    prompts, output_lens = peer.build_workload(
        peer.parse_args(["--engine=minisgl", f"--model={tiny_qwen3}", *TINY])
    )
    digest = peer.workload_digest(prompts, output_lens)
    for r in (theirs, ours):
        assert r["workload_digest"] == digest and r["num_output_tokens"] == sum(output_lens)
        assert r["seconds"] > 0
    # The peer child imported the stand-in, with nothing of ours on its path.
    seen = json.loads(record.read_text())
    assert Path(seen["file"]).resolve().is_relative_to(fake.resolve())
    assert str(ROOT) not in seen["sys_path"] and seen["sys_path"][0] == str(fake / "python")
    assert seen["kwargs"]["attention_backend"] == "fi"
    assert theirs["package"] == [str(fake / "python" / "minisgl")]
    assert theirs["received_output_tokens"] == sum(output_lens)
    assert theirs["settings"].startswith("fi graphs ? (bs<=None) overlap=on, radix, page 256")
    # Ours ran our package; the table comes last, with the ratio of the two rates.
    assert Path(ours["package"]) == ROOT / "minisgl"
    header, rule, our_row, their_row = done.stdout.strip().splitlines()[-4:]
    assert header.split()[0] == "engine" and set(rule) == {"-"}
    ratio = ours["output_tok_s"] / theirs["output_tok_s"]
    assert their_row.split()[0] == "mini-sglang" and our_row.split()[0] == "minisgl"
    assert our_row.split()[-1] == f"{ratio:.2f}"
