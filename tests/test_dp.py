"""`--dp`: the launcher's plan (ports, devices, the gateway's command line), and `--dp 2` run
for real: SGLang's worker endpoints checked against SGLang's shapes, round_robin through the
gateway, a gateway started by hand as docs/scaling.md does for several machines, a replica that
dies, one SIGTERM that stops the rest. Without sglang-router the launch is `--no-router` and the
gateway's tests skip, saying so."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from minisgl.api.dialects.sglang import model_info
from minisgl.config import DataParallelArgs, ServerArgs
from minisgl.runtime import dp as dp_module
from minisgl.runtime.dp import DataParallelStack, Placement, plan_placements
from minisgl.runtime.gateway import gateway_command, gateway_installed
from minisgl.runtime.launch import CHILD_FAILED_EXIT_CODE, http_url
from minisgl.runtime.supervisor import StartupError
from minisgl.server import data_parallel_args, parse_server_args
from tests.dp_utils import (
    FAST_HEALTH_CHECKS,
    DataParallelProcess,
    free_port_block,
    prompt_tokens_served,
    start_dp,
)

API_KEY = "dp-test-key"
HTTP_TIMEOUT_S = 60.0
WAIT_S = 30.0
POLL_S = 0.1
needs_gateway = pytest.mark.skipif(
    not gateway_installed(), reason="sglang-router is not installed (pip install sglang-router)"
)


# ---- the plan, without processes ----------------------------------------------------------------


def test_dp_flags():
    _, ns = parse_server_args(
        ["--dp", "2", "--router-policy", "round_robin", "--router-args", "--a 1 'b c'"]
    )
    assert data_parallel_args(ns) == DataParallelArgs(2, "round_robin", ("--a", "1", "b c"), True)
    _, ns = parse_server_args(["--dp", "3", "--no-router"])
    assert data_parallel_args(ns).use_router is False
    for bad in (
        ["--router-policy", "random"],
        ["--no-router"],
        ["--dp", "0"],
        ["--dp", "2", "--router-policy", "fastest"],
        ["--dp", "2", "--shell"],
    ):
        with pytest.raises(SystemExit):
            parse_server_args(bad)


def test_gateway_command_line():
    args = ServerArgs(host="0.0.0.0", port=3000, api_key="k", shutdown_timeout_s=7.5)
    dp = DataParallelArgs(2, "round_robin", ("--health-check-interval-secs", "1"))
    urls = [http_url(args.host, 3001), http_url(args.host, 3002)]
    assert urls == ["http://127.0.0.1:3001", "http://127.0.0.1:3002"]
    command = gateway_command(args, dp, urls)
    assert command[:3] == [sys.executable, "-m", "sglang_router.launch_router"]
    assert command[-2:] == ["--health-check-interval-secs", "1"]  # the user's flags win
    if gateway_installed():  # the installed gateway's own parser reads what we mean
        from sglang_router.launch_router import parse_router_args

        parsed = parse_router_args(command[3:])
        assert (parsed.host, parsed.port, parsed.policy) == ("0.0.0.0", 3000, "round_robin")
        assert parsed.worker_urls == urls and parsed.api_key == "k"
        assert parsed.prometheus_port == 3003 and parsed.shutdown_grace_period_secs == 8
        assert parsed.health_check_interval_secs == 1


def test_urls_reach_wildcard_hosts():
    assert http_url("::", 5) == "http://[::1]:5"
    assert http_url("10.0.0.7", 5) == "http://10.0.0.7:5"


def test_placements_split_gpus_and_cores(monkeypatch):
    args = ServerArgs(tp_size=2)
    monkeypatch.setattr(dp_module, "_visible_gpus", lambda _: ["4", "5", "6", "7"])
    assert plan_placements(args, 2) == [Placement("4,5"), Placement("6,7")]
    with pytest.raises(StartupError, match="needs 6 GPUs; 4 visible"):
        plan_placements(args, 3)
    monkeypatch.setattr(dp_module, "_visible_gpus", lambda _: [])
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1, 2, 3, 4}, raising=False)
    cores = [p.cpus for p in plan_placements(args, 2)]
    assert cores == [frozenset({0, 1}), frozenset({2, 3, 4})]
    cores = [p.cpus for p in plan_placements(args, 7)]  # more replicas than cores: shared
    assert cores == [frozenset({i % 5}) for i in range(7)]


def test_tp_ranks_split_the_cores_of_their_replica(monkeypatch):
    from minisgl.scheduler.tp import cpu_threads_per_rank

    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {4, 5, 6, 7}, raising=False)
    assert cpu_threads_per_rank(ServerArgs(device="cpu", tp_size=2)) == 2


def test_what_dp_refuses(monkeypatch, capsys):
    monkeypatch.setattr(dp_module, "gateway_installed", lambda: False)
    with pytest.raises(StartupError) as info:
        DataParallelStack(ServerArgs(), DataParallelArgs(2)).start()
    assert "pip install sglang-router" in str(info.value) and "--no-router" in str(info.value)
    for flags in (["--nnodes", "2", "--dist-init-addr", "h:1"], ["--dist-init-addr", "h:1"],
                  ["--device", "cuda:1"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_server_args(["--dp", "2", *flags])
        assert "--dp places its replicas on this machine" in capsys.readouterr().err


class _FakeStack:
    """A replica without processes: it fails when told to."""

    def __init__(self, args: ServerArgs, replica: int) -> None:
        self.replica, self.url = replica, http_url(args.host, args.port)
        self.failed_with: str | None = None
        self.on_check = lambda: None
        self.shutdowns: list[bool] = []
        self.sentinels: list[int] = []
        self.children = self  # its own Children: sentinels, failure()

    def start(self) -> None: ...

    def wait_ready(self) -> None: ...

    def request_stop(self) -> None: ...

    def failure(self) -> str | None:
        self.on_check()
        return self.failed_with

    def shutdown(self, backend_failed: bool = False) -> None:
        self.shutdowns.append(backend_failed)


def test_a_lost_replica_is_stopped_and_the_rest_serve(monkeypatch, caplog):
    monkeypatch.setattr(dp_module, "ServerStack", _FakeStack)
    monkeypatch.setattr(dp_module, "plan_placements", lambda args, n: [Placement()] * n)
    launch = DataParallelStack(ServerArgs(port=5000), DataParallelArgs(2, use_router=False))
    launch.start()
    launch.wait_ready()
    assert launch.ready_message().endswith(
        "replicas at http://127.0.0.1:5001, http://127.0.0.1:5002"
    )
    first, second = launch._replicas
    second.failed_with = "sched1 exited unexpectedly (killed by SIGKILL)"
    first.on_check = launch.request_stop  # then SIGTERM arrives
    assert launch.watch() == 0
    assert "replica 1 (http://127.0.0.1:5002): sched1 exited" in caplog.text
    assert (first.shutdowns, second.shutdowns) == ([], [True])
    launch.shutdown()
    assert (first.shutdowns, second.shutdowns) == ([False], [True])  # only the live one, once
    lost_all = DataParallelStack(ServerArgs(port=5000), DataParallelArgs(2, use_router=False))
    lost_all.start()
    for replica in lost_all._replicas:
        replica.failed_with = "api exited"
    assert lost_all.watch() == CHILD_FAILED_EXIT_CODE  # nothing left to serve


def test_model_card_reports_paths_as_sglang_does(tiny_qwen3, monkeypatch):
    monkeypatch.chdir(tiny_qwen3.parent)
    info = model_info(ServerArgs(model=tiny_qwen3.name), str(tiny_qwen3), str(tiny_qwen3))
    assert info["model_path"] == info["tokenizer_path"] == str(tiny_qwen3.resolve())  # absolute
    assert (info["model_type"], info["architectures"]) == ("qwen3", ["Qwen3ForCausalLM"])
    hub = model_info(ServerArgs(model="Qwen/Qwen3-8B"), str(tiny_qwen3), str(tiny_qwen3))
    assert hub["model_path"] == "Qwen/Qwen3-8B"  # a hub id as typed: another machine can fetch it


# ---- two replicas, for real ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def replicas(tiny_qwen3) -> Iterator[DataParallelProcess]:
    """--dp 2 behind the gateway with round_robin, or with --no-router where the gateway is not
    installed (then the tests that need it skip)."""
    if gateway_installed():
        flags = ("--router-policy", "round_robin", "--router-args", FAST_HEALTH_CHECKS)
    else:
        flags = ("--no-router",)
    launch = start_dp(tiny_qwen3, 2, *flags, api_key=API_KEY)
    try:
        launch.wait_ready()
        yield launch
    finally:
        launch.stop()
        launch.log_path.unlink(missing_ok=True)


def _model_names(url: str, headers: dict[str, str]) -> list[str]:
    response = httpx.get(url + "/v1/models", headers=headers, timeout=HTTP_TIMEOUT_S)
    assert response.status_code == 200, response.text
    return [card["id"] for card in response.json()["data"]]


def test_replicas_serve_on_consecutive_ports(replicas, tiny_qwen3):
    for index in range(2):
        assert _model_names(replicas.replica_url(index), replicas.headers) == [str(tiny_qwen3)]
        # Each replica on its own share of the cores (the test inherits the launcher's).
        cores = plan_placements(ServerArgs(device="cpu"), 2)[index].cpus
        assert set(replicas.child(f"sched{index}").cpu_affinity()) == cores
    if gateway_installed():  # the gateway names the model too, and wants the key as well
        assert _model_names(replicas.url, replicas.headers) == [str(tiny_qwen3)]
        body = {"model": str(tiny_qwen3), "prompt": "hi", "max_tokens": 2}
        refused = httpx.post(replicas.url + "/v1/completions", json=body, timeout=HTTP_TIMEOUT_S)
        assert refused.status_code == 401
    else:
        with pytest.raises(httpx.ConnectError):  # --no-router: nothing on the gateway's port
            httpx.get(replicas.url + "/health", timeout=HTTP_TIMEOUT_S)


def test_worker_endpoints_have_sglang_shapes(replicas, tiny_qwen3):
    url = replicas.replica_url(0)
    with httpx.Client(base_url=url, headers=replicas.headers, timeout=HTTP_TIMEOUT_S) as http:
        info = http.get("/server_info").json()
        assert http.get("/get_server_info").json() == info  # SGLang's older name
        model = http.get("/model_info").json()
        assert http.get("/get_model_info").json() == model
    expected_info = {
        "model_path": str(tiny_qwen3.resolve()),
        "tokenizer_path": str(tiny_qwen3.resolve()),
        "served_model_name": str(tiny_qwen3),
        "is_generation": True,
        "context_length": 1024,  # tests.server_utils.TEST_SERVER_FLAGS
        "max_total_num_tokens": 4096,  # 4096 pages of 1 token
        "max_req_input_len": 1023,
        "page_size": 1,
        "tp_size": 1,
        "dp_size": 1,
    }
    assert {key: info[key] for key in expected_info} == expected_info
    assert API_KEY not in json.dumps(info)  # SGLang's echoes its key; ours never does
    assert model == {
        "model_path": str(tiny_qwen3.resolve()),
        "tokenizer_path": str(tiny_qwen3.resolve()),
        "is_generation": True,
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
    }
    worker_paths = ("/server_info", "/get_server_info", "/model_info", "/get_model_info")
    for path in (*worker_paths, "/get_load", "/health_generate"):
        assert httpx.get(url + path, timeout=HTTP_TIMEOUT_S).status_code == 401, path
    # A probe of an idle server runs a real one-token generation (so it needs the key).
    before = prompt_tokens_served(url)
    probe = httpx.get(url + "/health_generate", headers=replicas.headers, timeout=HTTP_TIMEOUT_S)
    assert probe.status_code == 200
    deadline_s = time.monotonic() + WAIT_S  # the scheduler publishes its counters every 50 ms
    while prompt_tokens_served(url) == before and time.monotonic() < deadline_s:
        time.sleep(POLL_S)
    assert prompt_tokens_served(url) == before + 1


def _load(url: str) -> dict:
    response = httpx.get(url + "/get_load", headers={"Authorization": f"Bearer {API_KEY}"})
    (load,) = response.json()  # one entry: a minisgl server is one data-parallel rank
    return load


IDLE_LOAD = {
    "dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_waiting_reqs_by_priority": {},
    "num_tokens": 0,
}  # fmt: skip


def test_get_load_counts_what_runs(replicas):
    url = replicas.replica_url(1)
    assert _load(url) == IDLE_LOAD
    prompt = list(range(1000, 1100))
    # As long as the tiny model allows (1024 positions): it decodes fast, and the API process can
    # stream well behind the scheduler, so the load is polled from the moment the headers arrive
    # rather than after the first chunk (by then the scheduler may already be done).
    body = {"prompt": prompt, "max_tokens": 900, "ignore_eos": True, "stream": True}
    seen_running = None
    with httpx.stream(
        "POST", url + "/v1/completions", json=body, headers=replicas.headers, timeout=HTTP_TIMEOUT_S
    ) as stream:
        assert stream.status_code == 200
        deadline_s = time.monotonic() + WAIT_S
        while seen_running is None and time.monotonic() < deadline_s:
            load = _load(url)
            if load["num_reqs"] and not load["num_waiting_reqs"]:
                seen_running = load
    assert seen_running is not None, "the running request never showed in /get_load"
    assert seen_running["num_reqs"] == 1
    assert seen_running["num_tokens"] >= len(prompt)
    deadline_s = time.monotonic() + WAIT_S  # the disconnect aborts it; its pages come back
    while _load(url)["num_reqs"] and time.monotonic() < deadline_s:
        time.sleep(POLL_S)
    assert _load(url) == IDLE_LOAD


@needs_gateway
def test_round_robin_sends_requests_to_both_replicas(replicas, tiny_qwen3):
    urls = [replicas.replica_url(i) for i in range(2)]
    before = [prompt_tokens_served(url) for url in urls]
    for i in range(4):
        body = {"model": str(tiny_qwen3), "prompt": f"request {i}", "max_tokens": 2}
        response = httpx.post(
            replicas.url + "/v1/completions",
            json=body,
            headers=replicas.headers,
            timeout=HTTP_TIMEOUT_S,
        )
        assert response.status_code == 200, response.text
    deadline_s = time.monotonic() + WAIT_S  # counters are published every 50 ms
    while True:
        after = [prompt_tokens_served(url) for url in urls]
        if all(a > b for a, b in zip(after, before, strict=True)):
            break
        assert time.monotonic() < deadline_s, (before, after)
        time.sleep(POLL_S)
    # One scrape for every replica: the gateway adds a worker_addr label ...
    metrics = httpx.get(replicas.url + "/engine_metrics", headers=replicas.headers).text
    assert all(f'worker_addr="{url}"' in metrics for url in urls)
    # ... and serves its own metrics on --port + N + 1.
    gateway_metrics = httpx.get(f"http://127.0.0.1:{replicas.port + 3}/metrics")
    assert gateway_metrics.status_code == 200 and "smg_" in gateway_metrics.text


@needs_gateway
def test_a_gateway_started_by_hand_fronts_the_replicas(replicas, tiny_qwen3):
    """docs/scaling.md, several machines: the gateway with --worker-urls in front of servers
    started on their own (here: the same replicas, a second gateway on another port)."""
    port = free_port_block(2)
    gateway = subprocess.Popen(
        [
            *(sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"),
            *("--port", str(port), "--policy", "cache_aware", "--api-key", API_KEY),
            *("--worker-urls", replicas.replica_url(0), replicas.replica_url(1)),
            *("--prometheus-port", str(port + 1), "--log-level", "warn"),
        ]
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline_s = time.monotonic() + WAIT_S
        while True:  # it registers the workers in the background
            with contextlib.suppress(httpx.HTTPError, AssertionError):
                if _model_names(url, replicas.headers) == [str(tiny_qwen3)]:
                    break
            assert time.monotonic() < deadline_s and gateway.poll() is None
            time.sleep(POLL_S)
        body = {"model": str(tiny_qwen3), "prompt": "by hand", "max_tokens": 2}
        response = httpx.post(
            url + "/v1/completions", json=body, headers=replicas.headers, timeout=HTTP_TIMEOUT_S
        )
        assert response.status_code == 200, response.text
    finally:
        gateway.send_signal(signal.SIGINT)  # the gateway's graceful stop
        try:
            gateway.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            gateway.kill()
            gateway.wait()


def _healthy_workers(launch: DataParallelProcess) -> set[str]:
    response = httpx.get(launch.url + "/workers", headers=launch.headers, timeout=HTTP_TIMEOUT_S)
    return {w["url"] for w in response.json()["workers"] if w["is_healthy"]}


def test_a_dead_replica_is_reported_and_sigterm_stops_the_rest(replicas, tiny_qwen3):
    replicas.child("api1").kill()
    deadline_s = time.monotonic() + WAIT_S
    reported = "replica 1 (http://127.0.0.1:{}): api1 exited unexpectedly (killed by SIGKILL)"
    while reported.format(replicas.port + 2) not in replicas.log():
        assert time.monotonic() < deadline_s, replicas.log()
        time.sleep(POLL_S)
    gone = {"sched1", "detok1"}  # stopped by the launcher with their API server
    while gone & {p.name().removeprefix("minisgl:") for p in replicas.descendants()}:
        assert time.monotonic() < deadline_s, replicas.descendants()
        time.sleep(POLL_S)
    # Every later request is answered, by replica 0: through the gateway, once it no longer
    # lists replica 1 (the launcher removes it; the gateway does that in the background).
    url = replicas.replica_url(0)
    if gateway_installed():
        url = replicas.url
        while replicas.replica_url(1) in _healthy_workers(replicas):
            assert time.monotonic() < deadline_s
            time.sleep(POLL_S)
    for i in range(4):
        body = {"model": str(tiny_qwen3), "prompt": f"still here {i}", "max_tokens": 2}
        response = httpx.post(
            url + "/v1/completions", json=body, headers=replicas.headers, timeout=HTTP_TIMEOUT_S
        )
        assert response.status_code == 200, response.text
    assert replicas.proc.poll() is None  # the launcher keeps serving with one replica
    assert replicas.stop() == 0
    assert replicas.leftovers == []
    assert "Traceback" not in replicas.log()
