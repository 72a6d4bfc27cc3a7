"""KVPoolConnector: vLLM's v1 KV connector over kvpool, so vLLM engines share and reuse prefixes.

    vllm serve MODEL --block-size 32 --kv-transfer-config '{"kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "service.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvpool_url": "http://127.0.0.1:8000"}}'

Extra config keys: `kvpool_url` (required), `kvpool_api_key` (a Bearer key of KVPOOL_API_KEYS; its
tenant must be in KVPOOL_IPC_TENANTS), `timeout_s` (per HTTP call, 5), `retry_interval_s` (how long
calls are skipped after a fault, 5), `max_queued_saves` (64; one more makes the step wait).

Scheduler side: a new request's token ids create a kvpool sequence (the *pin*): its block table is the
cached prefix, held (not evictable) until its first save, or until the request finishes or is aborted.
The hit answered is that prefix cut to vLLM's block size. Worker side: the loads copy the pinned pages
into vLLM's blocks before the forward, then check that the pin still lives on the server whose pool is
mapped (one call, whose answer names the instance; else the blocks are reported as load errors and vLLM
recomputes them). After the forward, every request whose computed tokens filled more kvpool pages is
queued for a save, which the step does not wait for: the request's first save appends to its pin (which
holds what kvpool had at the lookup), a later one to a sequence created from its token ids (what kvpool
has already is matched, not copied); the rest appended (the append's answer names the server's instance:
it must be the mapped one), its K/V copied from vLLM's blocks into the pool at the appended slots, and
the sequence freed, which commits the pages to kvpool's prefix cache. vLLM keeps a finished request's
blocks until its saves are done (request_finished answers True; get_finished reports them), and a step
that reuses a preempted request's blocks first lets its saves finish (handle_preemptions). Each side's
kvpool calls and copies run on a thread of its own (vllm_thread). K/V moves only through the mapped
pool.

vLLM's block size and kvpool's page size are independent: vllm_copy moves runs of gcd(page, block)
tokens, every layer in one compiled pass (torch ops where it is not built). A request's `cache_salt`
salts kvpool's prefix hashes, so different salts never share pages. One worker (no tensor or
pipeline parallelism), and the block layouts of vLLM's CPU attention and of its GPU backends (flash_attn,
triton_attn, flashinfer: vllm_layout), are supported; others are refused at start. On a GPU the K/V moves
through torch ops (on the connector's thread, which waits for the device where the CPU path waits for its
copies), and a CUDA pool (kvpool serving on the GPU) is mapped by CUDA IPC.
"""

import atexit
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import httpx
import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.core.sched.output import SchedulerOutput

from service.core.errors import KVPoolError
from service.integrations.kvpool_link import KVPoolLink
from service.integrations.vllm_copy import KVCopier, Writer
from service.integrations.vllm_layout import Layout, check_layout
from service.integrations.vllm_metadata import Job, KVPoolMetadata, LoadJob, Pin, SaveJob, model_geometry
from service.integrations.vllm_thread import WorkerThread

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from service.client import SequenceInfo

logger = logging.getLogger(__name__)


class KVPoolConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        if not extra.get("kvpool_url"):
            raise ValueError("KVPoolConnector needs kv_connector_extra_config.kvpool_url (e.g. http://127.0.0.1:8000)")
        unknown = set(extra) - {"kvpool_url", "kvpool_api_key", "timeout_s", "retry_interval_s", "max_queued_saves"}
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
        # Scheduler side.
        self._requests: dict[str, Request] = {}
        self._pins: dict[str, Pin] = {}
        self._saved: dict[str, int] = {}  # tokens of each request kvpool holds or a save is under way for
        self._loads: list[LoadJob] = []
        self._saving: set[str] = set()  # requests given a save: vLLM keeps their blocks until it is done
        # Worker side: layer index -> its KV cache [num_blocks, heads, block_size, 2 * head_dim], and the
        # attention backend's writer into it (what loads store K/V with).
        self._layers: dict[int, torch.Tensor] = {}
        self._writers: dict[int, Writer] = {}
        self._copier: KVCopier | None = None
        self._load_errors: set[int] = set()
        self._failed_reqs: set[str] = set()
        # Saves run on the thread; these are shared with it (under _lock).
        self._lock = threading.Lock()
        self._pending: Counter[str] = Counter()  # queued or running saves of each request
        self._save_reqs: set[str] = set()  # requests the scheduler gave a save (it delays their blocks' free)
        self._finishing: set[str] = set()  # of those, the finished ones whose saves are still pending
        # The connector's thread: every call on the link runs there (scheduler side: lookups, waited for, and
        # releases, not waited for; worker side: loads, waited for, and saves, not waited for).
        self._thread = WorkerThread(int(extra.get("max_queued_saves", 64)))
        self._waits: Counter[str] = Counter()  # counted on vLLM's thread (link.stats: on the connector's)
        atexit.register(self._thread.close)  # an exit without shutdown() still runs what is queued

    @property
    def stats(self) -> dict[str, int]:
        """Counters: faults_<kind>, incidents, loaded_tokens, saved_tokens, load_failures, ..."""
        return {**self._link.stats, **self._waits}

    def wait_for_saves(self) -> None:
        """Wait until every save queued so far is done (saves run on the connector's thread)."""
        self._thread.drain()

    # ==== scheduler side ==========================================================================
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        self._requests[request.request_id] = request
        pin = self._pins.get(request.request_id)
        if pin is None:
            pin = self._pin(request)
            if pin is None:
                return 0, False
        pin.start = num_computed_tokens
        return max(0, pin.hit - num_computed_tokens), False

    def _pin(self, request: "Request") -> Pin | None:
        link, token_ids, salt = self._link, list(request.all_token_ids), request.cache_salt

        def lookup() -> "SequenceInfo | None":
            if not link.usable():
                return None
            began = time.perf_counter_ns()
            info = link.create(token_ids, salt)
            link.stats["lookup_ns"] += time.perf_counter_ns() - began  # the scheduler waits for it
            return info

        info = self._thread.run(lookup)
        if info is None:
            return None
        hit = info.cached_tokens // self._block_size * self._block_size
        self._saved[request.request_id] = max(self._saved.get(request.request_id, 0), info.cached_tokens)
        # Kept even without a hit: the request's first save appends to it (build_connector_meta).
        pages = info.block_table[: -(-hit // link.page_size)]
        pin = Pin(info.seq_id, pages, hit, info.cached_tokens)
        self._pins[request.request_id] = pin
        return pin

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        pin = self._pins.get(request.request_id)
        if num_external_tokens > 0 and pin is not None:
            job = LoadJob(
                request.request_id,
                pin.seq_id,
                pin.pages,
                pin.start,
                num_external_tokens,
                list(blocks.get_block_ids()[0]),
            )
            self._loads.append(job)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVPoolMetadata(loads=self._loads)
        self._loads = []
        page_size, manager = self._link.page_size, self._kv_cache_manager
        if not page_size or manager is None:
            return meta
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None:
                continue
            tokens = request.all_token_ids
            # The KV of tokens [0, computed) is in vLLM's blocks after this step; save whole pages of it.
            computed = min(request.num_computed_tokens + num_new, len(tokens))
            end = computed // page_size * page_size
            if end <= self._saved.get(req_id, 0):
                continue
            self._saved[req_id] = end
            self._saving.add(req_id)
            block_ids = list(manager.get_block_ids(req_id)[0])[: -(-end // self._block_size)]
            job = SaveJob(req_id, list(tokens[: end + 1]), end, block_ids, request.cache_salt)
            pin = self._pins.pop(req_id, None)  # handed over: this step's loads from it run before the save
            if pin is not None:
                job.pin_id, job.pin_length = pin.seq_id, pin.cached
            meta.saves.append(job)
        meta.preempted = set(scheduler_output.preempted_req_ids or ())
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        pin = self._pins.pop(req_id, None)
        if pin is not None:
            self._release(pin.seq_id)  # if kvpool restarted meanwhile, the pin went with it
        self._requests.pop(req_id, None)
        self._saved.pop(req_id, None)
        # A request given saves keeps its blocks until the worker's get_finished says they are copied.
        if req_id in self._saving:
            self._saving.discard(req_id)
            return True, None
        return False, None

    def _release(self, seq_id: str) -> None:
        """Free a pin on the connector's thread; vLLM's scheduler does not wait for it."""

        def release() -> None:
            began = time.perf_counter_ns()
            self._link.free(seq_id)
            self._link.stats["release_ns"] += time.perf_counter_ns() - began

        if self._thread.submit(release):
            self._waits["release_queue_full"] += 1

    # ==== worker side =============================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = self._vllm_config.compilation_config.static_forward_context
        layouts: set[Layout] = set()
        for name, cache in kv_caches.items():
            layer = layers[name]
            layouts.add(check_layout(layer, cache))
            if cache.dim() == 4 and cache.shape[2] != self._block_size:  # kernel blocks smaller than vLLM's
                raise ValueError(
                    f"KVPoolConnector: layer {name} stores blocks of {cache.shape[2]} tokens, vLLM's block size "
                    f"is {self._block_size}: set --block-size to the attention backend's block size"
                )
            index = extract_layer_index(name)
            self._layers[index] = cache
            self._writers[index] = partial(_write_layer, layer, cache)
        if sorted(self._layers) != list(range(self._link.model.num_layers)):
            raise ValueError(
                f"KVPoolConnector: expected layers 0..{self._link.model.num_layers - 1}, "
                f"vLLM registered {sorted(self._layers)}"
            )
        if len(layouts) != 1:
            raise ValueError(f"KVPoolConnector: the layers' KV block layouts differ: {sorted(x.name for x in layouts)}")
        self._copier = KVCopier(self._layers, self._writers, self._block_size, layout=layouts.pop())

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolMetadata)
        self._failed_reqs = set()
        if meta.loads:
            self._thread.run(lambda: self._run_loads(meta.loads))  # the forward needs them: wait

    def _run_loads(self, loads: list[LoadJob]) -> None:
        began = time.perf_counter_ns()
        for job in loads:
            if not self._guarded(self._load, job):
                self._link.stats["load_failures"] += 1
                self._failed_reqs.add(job.req_id)
                first, stop = job.start // self._block_size, -(-(job.start + job.count) // self._block_size)
                self._load_errors.update(job.block_ids[first:stop])
        self._link.stats["load_ns"] += time.perf_counter_ns() - began  # copies and checks: the step waits

    def _load(self, job: LoadJob) -> bool:
        link = self._link
        if not link.usable():  # may map a new pool (a restart): read link.pool after it
            return False
        pool = link.pool
        if pool is None:
            return False
        assert self._copier is not None
        began = time.perf_counter_ns()
        self._copier.load(pool.blocks, job.pages, job.block_ids, job.start, job.start + job.count)
        link.stats["load_copy_ns"] += time.perf_counter_ns() - began
        # The copy is right only if the pin (hence its pages) lived throughout on the mapped server: the pin
        # exists now on the mapped instance (one call, its answer naming the instance; a server loses its
        # sequences when it stops and its id is new at every start, so the pin was there all along).
        if not link.holds(job.pin_id):
            return False
        link.stats["loaded_tokens"] += job.count
        return True

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv copies every layer before the forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata", **kwargs: Any
    ) -> None:
        return  # wait_for_save copies every layer at once: one HTTP transaction per request, not per layer

    def wait_for_save(self) -> None:
        """Queue this step's saves on the connector's thread; the step does not wait for them."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolMetadata)
        failed = self._failed_reqs  # this step's failed loads (the loads ran before the forward)
        # On a GPU the forward is only queued on vLLM's stream when this runs: the saves, on the connector's
        # thread, wait for this event before they read the blocks.
        forward_done = None
        if meta.saves and self._copier is not None and self._copier.device.type == "cuda":
            forward_done = torch.cuda.Event()
            forward_done.record(torch.cuda.current_stream(self._copier.device))
        for job in meta.saves:
            with self._lock:
                self._save_reqs.add(job.req_id)
                # A request whose load failed ran this step on unloaded blocks: vLLM recomputes it, we save none
                # of it (and release its pin: nothing was appended to it, its pages are cached ones).
                skip = job.req_id in failed
                if not skip:
                    self._pending[job.req_id] += 1
            if skip:
                if job.pin_id is not None:
                    self._thread.submit(partial(self._free, job.pin_id))
                continue
            if self._thread.submit(partial(self._run_save, job, forward_done)):
                self._waits["save_queue_full"] += 1

    def _free(self, seq_id: str) -> None:
        self._link.free(seq_id)

    def _run_save(self, job: SaveJob, forward_done: "torch.cuda.Event | None" = None) -> None:
        began = time.perf_counter_ns()
        try:
            if forward_done is not None:
                forward_done.synchronize()  # the forward that computed these blocks has written them
            if self._link.usable():
                self._guarded(self._save, job)
            elif job.pin_id is not None:
                self._link.forget(job.pin_id)  # released once kvpool answers again (if the pin outlived it)
        finally:
            self._link.stats["save_ns"] += time.perf_counter_ns() - began  # on the thread, not in the step
            with self._lock:
                self._pending[job.req_id] -= 1
                if self._pending[job.req_id] <= 0:
                    del self._pending[job.req_id]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The finished requests whose saves are all done: vLLM may free their blocks now."""
        with self._lock:
            self._finishing |= finished_req_ids & self._save_reqs
            self._save_reqs -= finished_req_ids
            done = {req_id for req_id in self._finishing if req_id not in self._pending}
            self._finishing -= done
        return done or None, None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """vLLM freed the blocks of preempted requests (no request_finished) and may write into them in this
        step: their queued saves read those blocks, so they run first."""
        assert isinstance(kv_connector_metadata, KVPoolMetadata)
        with self._lock:
            waiting = bool(kv_connector_metadata.preempted & set(self._pending))
        if waiting:
            self._waits["preemption_waits"] += 1
            self._thread.drain()

    def _guarded(self, fn: Callable[[Job], bool | None], job: Job) -> bool:
        """fn(job); a bug of ours or an unexpected error fails this one load or save, never vLLM's step."""
        try:
            return fn(job) is not False
        except Exception:
            self._link.stats["internal_errors"] += 1
            logger.exception("kvpool connector: %s of request %s failed", fn.__name__.strip("_"), job.req_id)
            return False

    def _save(self, job: SaveJob) -> None:
        link = self._link
        if job.pin_id is not None:  # the request's pin: it holds the prefix kvpool had at the lookup
            seq_id, start = job.pin_id, job.pin_length
        else:
            seq = link.create(job.token_ids, job.cache_salt)
            if seq is None:
                return
            seq_id, start = seq.seq_id, seq.cached_tokens
        if start < job.end:
            try:
                appended = link.client.append(seq_id, token_ids=job.token_ids[start : job.end], instance=True)
            except KVPoolError as exc:  # refused whole (out of pages, quota): nothing was appended
                link.record(exc)
                link.free(seq_id)
                return
            except httpx.HTTPError as exc:
                # Not freed: the append may have run, and a free would commit its unwritten pages.
                link.record(exc)
                link.stats["sequences_left"] += 1
                return
            if not self._write(job, start, seq_id, appended.block_table, appended.instance_id):
                link.stats["sequences_left"] += 1  # the same: written into a pool that is not the server's
                return
            link.stats["saved_tokens"] += job.end - start
        link.free(seq_id)

    def _write(self, job: SaveJob, start: int, seq_id: str, pages: list[int], instance_id: str | None) -> bool:
        """Copy tokens [start, job.end) into the sequence's `pages`; True once written into the pool of the
        server that holds the sequence (the one the free then commits it on).

        `instance_id`: the server that ran the append. The mapped one: its pages are the mapped pool's, and
        no check after the write is needed (a server restarted after the append has lost the sequence, so
        the free finds nothing to commit). Another one (restarted before the append): the new pool is
        mapped, and written only if that is the server that ran the append. Unnamed (an older server): the
        server is checked after the write, and a restart found then is written again only if the server
        answering holds this sequence on these very pages (otherwise those page ids are someone else's).
        """
        link = self._link
        if instance_id is not None and instance_id != link.instance_id:  # connect() counts the restart
            if not link.connect(at_start=False) or link.instance_id != instance_id:
                return False
        for attempt in range(2):
            pool = link.pool
            if pool is None:
                return False
            if attempt and not link.holds(seq_id, pages):
                return False
            assert self._copier is not None
            began = time.perf_counter_ns()
            self._copier.save(pool.blocks, job.block_ids, pages, start, job.end)
            link.stats["save_copy_ns"] += time.perf_counter_ns() - began
            if instance_id is not None or link.same_instance():
                return True
            if not link.connect(at_start=False):
                return False
        return False

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._thread.close()  # what is queued runs first
        if self.stats:
            logger.info("kvpool connector (%s): %s", self.role.name.lower(), self.stats)
        self._link.close()


def _write_layer(layer: Any, cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """Store K/V [T, H, D] at `slots` of one layer's cache with its attention backend's own writer."""
    layer.impl.do_kv_cache_update(layer, key, value, cache, slots)
