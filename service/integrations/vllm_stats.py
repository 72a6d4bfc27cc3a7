"""The connector's counters in vLLM's own metrics: `GET /metrics` of a vLLM server shows
`vllm:kvpool_connector_total{counter=...}` (loaded_tokens, saved_tokens, load_ns, save_ns, lookup_ns, faults_...).

vLLM asks each side's connector for its stats after every step (`get_kv_connector_stats`, the worker's
through the step's output, the scheduler's in the engine core), adds them up (`aggregate`) and hands the
sum to its Prometheus logger in the API server's process, which calls `observe` with it. Each answer holds
the counters' growth since the side's last answer, so that the sums are the counters themselves.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats, PromMetric

METRIC = "vllm:kvpool_connector"


@dataclass
class KVPoolConnectorStats(KVConnectorStats):
    """data: counter name -> growth (ints: tokens, calls, nanoseconds)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVPoolConnectorStats":
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class GrowthSince:
    """The growth of a counter mapping since the previous call (the mapping is written on the connector's
    thread; `dict()` of a Counter copies it in one step under the GIL)."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def __call__(self, counters: Mapping[str, int]) -> KVPoolConnectorStats | None:
        now = dict(counters)
        grown = {k: v - self._last.get(k, 0) for k, v in now.items() if v != self._last.get(k, 0)}
        self._last = now
        return KVPoolConnectorStats(data=grown) if grown else None


class KVPoolPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM's Counter class (prometheus_client's, or its multiprocess-safe wrapper)
        counter: Any = self._counter_cls(
            name=METRIC, documentation="The kvpool connector's counters (KVPoolConnector.stats).",
            labelnames=[*labelnames, "counter"],
        )  # fmt: skip
        self._counter: Counter = counter

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.items():
            if value > 0:
                self._counter.labels(*labels, key).inc(value)
