"""KVPoolConnector: vLLM's v1 KV connector over kvpool, so vLLM engines share and reuse prefixes.

    vllm serve MODEL --block-size 32 --kv-transfer-config '{"kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "service.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvpool_url": "http://127.0.0.1:8000"}}'

Extra config keys: `kvpool_url` (required), `kvpool_api_key` (a Bearer key of KVPOOL_API_KEYS; its
tenant must be in KVPOOL_IPC_TENANTS), `timeout_s` (per HTTP call, 5), `retry_interval_s` (how long
calls are skipped after a fault, 5), `max_queued_saves` (64; one more makes the step wait), `load_wait_s`
(2; how long a consumer's lookup waits for the tokens a producer announced in kv_transfer_params),
`reserve_pages` (true: a new prompt's pages are appended right after its lookup, a finished request's last
pages when it finishes, neither waited for: vllm_reserve).

Scheduler side: a new request's token ids create a kvpool sequence (the *pin*): its block table is the cached
prefix, held (not evictable) until its first save, or until the request finishes or is aborted, and until
every rank has reported its loads from it. The hit answered is that prefix cut to vLLM's block size: one call
per request, whatever the number of ranks, whose answer names the server instance. Worker side, on every rank:
the loads copy the rank's part of the pinned pages into vLLM's blocks before the forward, without a call, if
the pin's instance is the one whose pool is mapped (else the blocks are reported as load errors and vLLM
recomputes them). Saves: every request whose
computed tokens filled more kvpool pages gets a save; the scheduler appends its pages, all of a step's in one
call (to the request's pin, which holds what kvpool had at the lookup, then to the sequence of its earlier
saves, or to a sequence created from its token ids: what kvpool has already is matched, not copied), each rank
copies its part of the K/V into them after the forward, without the step waiting, and reports it written or
not; once every rank has, the scheduler commits the pages to kvpool's prefix cache only if every rank wrote its
part (else the sequence is released uncommitted). vLLM keeps a finished request's blocks until its saves are
done on every rank (request_finished answers True; get_finished reports them), and a step that reuses a
preempted request's blocks first lets its saves finish (handle_preemptions). Each side's kvpool calls and
copies run on a thread of its own (vllm_thread). K/V moves only through the mapped pool. KVPoolConnector, the
class vLLM loads, holds what both sides share (the link to kvpool, the thread, the counters) and forwards each
of vLLM's calls to its role's object: vllm_scheduler's or vllm_worker's.

Tensor and pipeline parallelism: kvpool's pool has the whole model's geometry (every layer and KV head) and
each rank reads and writes its own KV heads and layers of the same pages (vllm_worker.Shard), so a prefix
saved at one tensor parallel degree loads at any other. vLLM's block size and kvpool's page size are
independent: vllm_copy moves runs of gcd(page, block) tokens, every layer in one compiled pass where a rank
holds the whole pool's geometry (torch ops for a part of it, or where the compiled copy is not built). A
request's `cache_salt` salts kvpool's prefix hashes, so different salts never share pages. Block layouts:
those of vLLM's CPU attention and of its GPU backends (flash_attn, triton_attn, flashinfer: vllm_layout,
read through views), and any other a layer's writer stores as a permutation of its tokens' elements
(vllm_blockmap, learned at start: vLLM's AMX blocks, FP8 caches, MLA latents; copied for a whole pool's
heads only, so not under tensor parallelism that splits the heads); what the connector refuses at start is
listed in docs/vllm.md. On a GPU the K/V moves through
torch ops (on the connector's thread, which waits for the device where the CPU path waits for its copies),
and a CUDA pool (kvpool serving on the GPU) is mapped by CUDA IPC.
"""

import atexit
import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.core.sched.output import SchedulerOutput

from service.integrations.kvpool_link import KVPoolLink
from service.integrations.vllm_metadata import Role, model_geometry
from service.integrations.vllm_scheduler import KVPoolConnectorScheduler
from service.integrations.vllm_stats import GrowthSince, KVPoolConnectorStats, KVPoolPromMetrics
from service.integrations.vllm_thread import ConnectorThread
from service.integrations.vllm_worker import KVPoolConnectorWorker

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class KVPoolConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        if not extra.get("kvpool_url"):
            raise ValueError("KVPoolConnector needs kv_connector_extra_config.kvpool_url (e.g. http://127.0.0.1:8000)")
        known = {"kvpool_url", "kvpool_api_key", "timeout_s", "retry_interval_s", "max_queued_saves", "load_wait_s"}
        known.add("reserve_pages")
        unknown = set(extra) - known
        if unknown:
            raise ValueError(f"KVPoolConnector: unknown kv_connector_extra_config keys {sorted(unknown)}")
        self._block_size = vllm_config.cache_config.block_size
        is_worker = role == KVConnectorRole.WORKER
        self._link = KVPoolLink(
            str(extra["kvpool_url"]),
            extra.get("kvpool_api_key"),
            model_geometry(vllm_config),
            float(extra.get("timeout_s", 5.0)),
            float(extra.get("retry_interval_s", 5.0)),
            "worker" if is_worker else "scheduler",
        )
        self._link.connect(at_start=True)  # a mismatch raises here; kvpool down only starts an incident
        if role == KVConnectorRole.SCHEDULER:
            # kvpool is a cache: a load that fails after the match is recomputed, never a failed request.
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        # The connector's thread: every call on the link runs there (scheduler side: lookups and appends, waited
        # for, and releases, not waited for; worker side: loads, waited for, and saves, not waited for).
        self._thread = ConnectorThread(int(extra.get("max_queued_saves", 64)), ordered=not is_worker)
        self._waits: Counter[str] = Counter()  # counted on vLLM's thread (link.stats: on the connector's)
        atexit.register(self._close)  # an exit without shutdown() (vLLM's engine failed) still runs what is queued
        transfer = self._kv_transfer_config
        reserve = bool(extra.get("reserve_pages", True))
        kv_role = Role(transfer.is_kv_consumer, transfer.is_kv_producer, float(extra.get("load_wait_s", 2.0)), reserve)
        self._growth = GrowthSince()  # the counters' growth, for vLLM's metrics (vllm_stats)
        # One object per role, each only in its role.
        self._scheduler = (
            KVPoolConnectorScheduler(
                self._link,
                self._thread,
                self._waits,
                self._block_size,
                vllm_config.parallel_config.world_size,
                kv_role,
            )
            if role == KVConnectorRole.SCHEDULER
            else None
        )
        self._worker = (
            KVPoolConnectorWorker(vllm_config, self._link, self._thread, self._waits, self._block_size)
            if is_worker
            else None
        )

    @property
    def stats(self) -> dict[str, int]:
        """Counters: faults_<kind>, incidents, loaded_tokens, saved_tokens (committed), load_failures, ... The
        scheduler's include its workers' (as they reported them each step), summed over the ranks."""
        own = self._link.stats + self._waits
        return dict(own + self._scheduler.worker_stats if self._scheduler is not None else own)

    # ==== both sides: the counters in vLLM's metrics (vllm_stats) =================================
    def get_kv_connector_stats(self) -> KVPoolConnectorStats | None:
        # Each side's own counters: the workers report theirs to vLLM too, so the scheduler's copy of them
        # (worker_stats, in `stats`) stays out of vLLM's metrics.
        return self._growth(dict(self._link.stats + self._waits))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVPoolConnectorStats:
        return KVPoolConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVPoolPromMetrics:
        return KVPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def wait_for_saves(self) -> None:
        """Wait until every job queued so far on the connector's thread is done: a worker's saves (copies), a
        scheduler's releases (commits of the saves its ranks have all reported, pending_saves), and the answer of
        its last call of frees read (it sends them without waiting: vllm_saves.free_all)."""
        self._thread.drain()
        self._thread.call(self._link.client.settle)

    @property
    def pending_saves(self) -> int:
        """Scheduler side: saves that not every rank has reported yet (vLLM's steps bring their reports)."""
        return self._scheduler_side().pending_saves()

    def _scheduler_side(self) -> KVPoolConnectorScheduler:
        assert self._scheduler is not None, "a scheduler-side call on the worker's connector"
        return self._scheduler

    def _worker_side(self) -> KVPoolConnectorWorker:
        assert self._worker is not None, "a worker-side call on the scheduler's connector"
        return self._worker

    # ==== scheduler side: vllm_scheduler ==========================================================
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self._scheduler_side().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler_side().build_connector_meta(scheduler_output, self._kv_cache_manager)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().request_finished(request, block_ids)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self._scheduler_side().update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self._scheduler_side().has_pending_push_work()

    # ==== worker side: vllm_worker (its methods say what each call does) ==========================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._worker_side().start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv copies every layer before the forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata", **kwargs: Any
    ) -> None:
        return  # wait_for_save copies every layer at once: one HTTP transaction per request, not per layer

    def wait_for_save(self) -> None:
        self._worker_side().wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker_side().get_finished(finished_req_ids)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._worker_side().handle_preemptions(kv_connector_metadata)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker_side().build_connector_worker_meta()

    def _close(self) -> None:
        if self._scheduler is not None:
            self._scheduler.discard_open_saves()  # no rank reports them any more: released uncommitted
        self._thread.close()  # what is queued runs first

    def shutdown(self) -> None:
        self._close()
        if self.stats:
            logger.info("kvpool connector (%s): %s", self.role.name.lower(), self.stats)
        self._link.close()
