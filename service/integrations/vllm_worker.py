"""The worker side of KVPoolConnector (vllm.py): copies K/V between vLLM's blocks and kvpool's mapped pool.

One per rank. kvpool's pages hold every layer and every KV head of the model (one pool geometry whatever
the parallelism, so that prefixes are shared across tensor parallel degrees): a rank reads and writes its
own part of each page, the KV heads it holds (`Shard`; a rank holding a replica of a KV head
that another rank writes, where tensor parallel size > KV heads, reads it and writes nothing).

Before the forward, the step's loads copy the pinned pages into vLLM's blocks (and check that the pin
still lives on the mapped server; else the blocks are reported as load errors). After the forward, the
step's saves are queued on the connector's thread and the step goes on: each writes this rank's part of the
pages the scheduler appended, into the pool of the server that appended them. Every save is reported
written or failed to the scheduler (build_connector_worker_meta), which commits the pages once every rank
has written them. get_finished reports the finished requests whose saves are done (a finished request whose
last pages the next step saves, once those are: KVPoolMetadata.finish_saved); handle_preemptions lets the
saves of preempted requests finish first.
"""

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.models.utils import extract_layer_index

from service.integrations.kvpool_link import KVPoolLink
from service.integrations.vllm_blockmap import BlockMap, LearnedCopier, UnknownLayout, learn_block_map
from service.integrations.vllm_copy import KVCopier, Writer
from service.integrations.vllm_layout import Layout, check_layout
from service.integrations.vllm_metadata import Job, KVPoolMetadata, KVPoolWorkerMeta, LoadJob, SaveJob
from service.integrations.vllm_thread import ConnectorThread

logger = logging.getLogger("service.integrations.vllm")


@dataclass(frozen=True)
class Shard:
    """This rank's part of each kvpool page: KV heads [first_head, first_head + num_heads) of every layer;
    `writes`: False for a replica of a head that another rank writes."""

    first_head: int
    num_heads: int
    writes: bool

    def of(self, blocks: torch.Tensor) -> torch.Tensor:
        """This rank's view of the pool's blocks [P + 1, 2, L, page, H, D] (strided unless it is all of it)."""
        return blocks[..., self.first_head : self.first_head + self.num_heads, :]


def head_shard(total_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int, bool]:
    """(first head, heads, writes) of tensor parallel rank `tp_rank`, as vLLM splits KV heads: H / tp each, or
    (tp > H) head rank // (tp / H) on tp / H ranks, of which the first writes it."""
    if tp_size <= total_heads:
        if total_heads % tp_size:
            raise ValueError(f"KVPoolConnector: {total_heads} KV heads do not split over {tp_size} ranks")
        per_rank = total_heads // tp_size
        return tp_rank * per_rank, per_rank, True
    replicas = tp_size // total_heads
    return tp_rank // replicas, 1, tp_rank % replicas == 0


class KVPoolConnectorWorker:
    """The worker role's state: vLLM's KV caches, this rank's shard, this step's load errors, the saves under
    way and their reports."""

    def __init__(
        self, vllm_config: VllmConfig, link: KVPoolLink, thread: ConnectorThread, waits: Counter[str], block_size: int
    ) -> None:
        self._vllm_config = vllm_config
        self._link, self._thread, self._waits, self._block_size = link, thread, waits, block_size
        # Layer index -> its KV cache [num_blocks, heads, block_size, 2 * head_dim],
        # and the attention backend's writer into it (what loads store K/V with).
        self._layers: dict[int, torch.Tensor] = {}
        self._writers: dict[int, Writer] = {}
        self._copier: KVCopier | LearnedCopier | None = None
        self._shard: Shard | None = None
        self._load_errors: set[int] = set()
        self._failed_reqs: set[str] = set()
        # Saves run on the thread; these are shared with it (under _lock).
        self._lock = threading.Lock()
        self._pending: Counter[str] = Counter()  # queued or running saves of each request
        self._save_reqs: set[str] = set()  # requests the scheduler gave a save (it delays their blocks' free)
        self._finishing: set[str] = set()  # of those, the finished ones whose saves are still pending
        self._awaiting: set[str] = set()  # finished requests whose last saves this step brings (finish_saved)
        self._written: Counter[int] = Counter()  # saves done since the last report, by save_id: written
        self._failed: Counter[int] = Counter()  # ... and not written
        self._loaded: Counter[str] = Counter()  # loads done since the last report (read or not), by pin
        self._reported: Counter[str] = Counter()  # the counters as last reported

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = self._vllm_config.compilation_config.static_forward_context
        if torch.cpu._is_amx_tile_supported():
            # Ask Linux for the AMX tile state now: vLLM's CPU attention (0.32) uses AMX tiles without asking when
            # a process's first forward attends over a context it did not compute (a hit loaded from kvpool),
            # and dies of SIGILL; a first forward that computed its prompt had asked.
            torch.cpu._init_amx()
        layouts: set[Layout] = set()
        maps: list[BlockMap] = []
        kv_scales: dict[int, tuple[float, float]] = {}
        for name, cache in kv_caches.items():
            layer = layers[name]
            layout = self._layout(layer, cache)
            if isinstance(layout, BlockMap):
                maps.append(layout)
                if self._link.model.dtype.startswith("float8"):
                    kv_scales[extract_layer_index(name)] = (float(layer._k_scale_float), float(layer._v_scale_float))
            else:
                layouts.add(layout)
            if cache.dim() == 4 and cache.shape[2] != self._block_size:  # kernel blocks smaller than vLLM's
                raise ValueError(
                    f"KVPoolConnector: layer {name} stores blocks of {cache.shape[2]} tokens, vLLM's block size "
                    f"is {self._block_size}: set --block-size to the attention backend's block size"
                )
            index = extract_layer_index(name)
            self._layers[index] = cache
            self._writers[index] = partial(_write_layer, layer, cache)
        model = self._link.model
        if sorted(self._layers) != list(range(model.num_layers)):
            raise ValueError(
                f"KVPoolConnector: expected layers 0..{model.num_layers - 1}, vLLM registered {sorted(self._layers)}"
            )
        self._shard = Shard(
            *head_shard(model.num_kv_heads, get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank())
        )
        # The compiled copy takes a whole pool's heads; a part of them is copied by torch ops.
        whole = self._shard.num_heads == model.num_kv_heads
        if maps:
            if layouts or any(not torch.equal(m.where, maps[0].where) for m in maps):
                raise ValueError("KVPoolConnector: the layers' KV block layouts differ")
            if not whole:
                raise ValueError(
                    "KVPoolConnector: a learned block layout (FP8 cache, AMX blocks) is copied for a whole pool's KV "
                    "heads only: tensor parallelism that splits the KV heads is not supported with it yet"
                )
            self._copier = LearnedCopier(self._layers, maps[0], kv_scales or None)
            return
        if len(layouts) != 1:
            raise ValueError(f"KVPoolConnector: the layers' KV block layouts differ: {sorted(x.name for x in layouts)}")
        cache_heads = self._layers[0].shape[1]
        if cache_heads != self._shard.num_heads:
            raise ValueError(
                f"KVPoolConnector: vLLM's cache holds {cache_heads} KV heads per rank, not {self._shard.num_heads}"
            )
        self._copier = KVCopier(self._layers, self._writers, self._block_size, native=whole, layout=layouts.pop())

    def _layout(self, layer: Any, cache: torch.Tensor) -> Layout | BlockMap:
        """A known view layout (vllm_layout) for a plain cache, else the block layout the layer's writer is
        seen to store (vllm_blockmap: AMX tiles, FP8 bytes, MLA latents); ValueError when neither reads it."""
        model = self._link.model
        known = ""
        if not model.kv_lora_rank and not model.dtype.startswith("float8"):
            try:
                return check_layout(layer, cache)
            except ValueError as exc:
                known = f"{exc}; "
        write = probe_writer(layer, model.kv_lora_rank)
        components = 1 if model.kv_lora_rank else 2
        if model.kv_lora_rank and cache.dim() == 4 and cache.shape[1] == 1:
            cache = cache.squeeze(1)  # what an MLA layer writes into (vLLM's MLAAttention: [blocks, block, D])
        dtype = self._vllm_config.model_config.dtype  # what the writer takes K/V in
        assert isinstance(dtype, torch.dtype)
        try:
            return learn_block_map(write, cache, components, model.num_kv_heads, model.head_dim, dtype)
        except (UnknownLayout, RuntimeError) as exc:
            raise ValueError(
                f"KVPoolConnector: {known}the block layout {type(layer.impl).__name__} writes is not a permutation "
                f"of its tokens' K/V: {exc}"
            ) from exc

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        assert isinstance(meta, KVPoolMetadata)
        self._failed_reqs = set()
        if meta.finish_saved:  # (here: vLLM may ask get_finished before wait_for_save, which queues them)
            with self._lock:
                self._awaiting |= meta.finish_saved
        if meta.loads:
            self._thread.run(lambda: self._run_loads(meta.loads))  # the forward needs them: wait

    def _run_loads(self, loads: list[LoadJob]) -> None:
        began = time.perf_counter_ns()
        for job in loads:
            loaded = self._guarded(self._load, job)
            with self._lock:
                self._loaded[job.pin_id] += 1  # the scheduler holds the pin until every rank says so
            if not loaded:
                self._link.stats["load_failures"] += 1
                self._failed_reqs.add(job.req_id)
                first, stop = job.start // self._block_size, -(-(job.start + job.count) // self._block_size)
                self._load_errors.update(job.block_ids[first:stop])
        self._link.stats["load_ns"] += time.perf_counter_ns() - began  # copies and checks: the step waits

    def _load(self, job: LoadJob) -> bool:
        link = self._link
        if not link.usable():  # may map a new pool (a restart): read link.pool after it
            return False
        # The pin's pages are in the pool mapped here if the pin was made on its instance (a server's id is new
        # at every start). They hold their K/V throughout the copy: the scheduler keeps the pin until every rank
        # has reported this load, and no writer writes into the pool of an instance other than its step's.
        if link.instance_id != job.instance_id:  # restarted: map the new pool, if it is the one the pin is on
            if not link.connect(at_start=False) or link.instance_id != job.instance_id:
                return False
        pool = link.pool
        if pool is None:
            return False
        assert self._copier is not None and self._shard is not None
        began = time.perf_counter_ns()
        # A hit that stops one token short of the prompt ends inside a run of g = gcd(page, block) tokens: the
        # copy takes the whole run. The tokens past the hit are in a kvpool page that holds them and in a block
        # vLLM allocated (the run lies in one block, beside the hit's last token); vLLM writes their slots when
        # it computes them, before its attention reads them.
        g = math.gcd(link.page_size, self._block_size)
        end = -(-(job.start + job.count) // g) * g
        if isinstance(self._copier, LearnedCopier):  # a whole pool's heads (register_kv_caches)
            if not self._copier.load(pool.blocks, pool.scales, job.pages, job.block_ids, job.start, end):
                link.stats["load_scale_mismatches"] += 1
                return False
        else:
            self._copier.load(self._shard.of(pool.blocks), job.pages, job.block_ids, job.start, end)
        link.stats["load_copy_ns"] += time.perf_counter_ns() - began
        link.stats["loaded_tokens"] += job.count
        return True

    def wait_for_save(self, meta: KVConnectorMetadata) -> None:
        """Queue this step's saves on the connector's thread; the step does not wait for them."""
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
                # A request whose load failed ran this step on unloaded blocks: vLLM recomputes it, and this
                # rank does not write it (so that the scheduler releases its pages uncommitted).
                if job.req_id in failed:
                    self._failed[job.save_id] += 1
                    continue
                self._pending[job.req_id] += 1
            if self._thread.submit(partial(self._run_save, job, forward_done)):
                self._waits["save_queue_full"] += 1
        if meta.finish_saved:  # finished requests whose last saves were just queued (or given up)
            with self._lock:
                self._awaiting -= meta.finish_saved
                self._finishing |= meta.finish_saved

    def _run_save(self, job: SaveJob, forward_done: "torch.cuda.Event | None" = None) -> None:
        began = time.perf_counter_ns()
        written = False
        try:
            if forward_done is not None:
                forward_done.synchronize()  # the forward that computed these blocks has written them
            written = self._guarded(self._save, job)
        finally:
            self._link.stats["save_ns"] += time.perf_counter_ns() - began  # on the thread, not in the step
            with self._lock:
                (self._written if written else self._failed)[job.save_id] += 1
                self._pending[job.req_id] -= 1
                if self._pending[job.req_id] <= 0:
                    del self._pending[job.req_id]

    def _save(self, job: SaveJob) -> bool:
        """Write this rank's part of the job's pages; True once written into the pool of the server that
        appended them (the one whose free then commits them: a server restarted since has lost the
        sequence, and a page id of another instance is someone else's page)."""
        assert self._shard is not None and self._copier is not None
        if not self._shard.writes:
            return True  # a replica: the rank that holds the head first writes it
        link = self._link
        if not link.usable():
            return False
        if link.instance_id != job.instance_id:  # restarted: map the new pool, if it is the one that appended
            if not link.connect(at_start=False) or link.instance_id != job.instance_id:
                return False
        pool = link.pool
        if pool is None:
            return False
        began = time.perf_counter_ns()
        if isinstance(self._copier, LearnedCopier):  # a whole pool's heads (register_kv_caches)
            self._copier.save(pool.blocks, pool.scales, job.block_ids, job.pages, job.start, job.end)
        else:
            self._copier.save(self._shard.of(pool.blocks), job.block_ids, job.pages, job.start, job.end)
        link.stats["save_copy_ns"] += time.perf_counter_ns() - began
        link.stats["written_tokens"] += job.end - job.start
        return True

    def build_connector_worker_meta(self) -> KVPoolWorkerMeta | None:
        """The saves done since the last step, written or not, the loads done (by pin), and the counters'
        growth since: vLLM sums them over the ranks for the scheduler."""
        with self._lock:
            written, failed, loaded = self._written, self._failed, self._loaded
            self._written, self._failed, self._loaded = Counter(), Counter(), Counter()
        now = Counter(dict(self._link.stats)) + Counter(dict(self._waits))  # (dict(): one C-level copy each)
        grown = now - self._reported
        self._reported = now
        if not (written or failed or grown or loaded):
            return None
        return KVPoolWorkerMeta(written, failed, grown, loaded)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The finished requests whose saves are all done: vLLM may free their blocks now."""
        with self._lock:
            self._finishing |= (finished_req_ids & self._save_reqs) - self._awaiting
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

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors


def probe_writer(layer: Any, kv_lora_rank: int) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """The layer's own cache writer as vllm_blockmap's probes call it: (values [C, T, H, D], cache, slots)."""
    if kv_lora_rank:  # MLA: the latent [T, kv_lora_rank] and its rope part [T, 1, rope] (vLLM's mla_attention)

        def write_latent(values: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
            latent = values[0]  # [T, 1, D]
            k_scale = getattr(layer, "_k_scale", torch.ones(()))
            rope = latent[:, :, kv_lora_rank:].contiguous()
            layer.impl.do_kv_cache_update(latent[:, 0, :kv_lora_rank].contiguous(), rope, cache, slots,
                                          layer.kv_cache_dtype, k_scale)  # fmt: skip

        return write_latent
    return lambda values, cache, slots: _write_layer(layer, cache, values[0], values[1], slots)


def _write_layer(layer: Any, cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """Store K/V [T, H, D] at `slots` of one layer's cache with its attention backend's own writer."""
    layer.impl.do_kv_cache_update(layer, key, value, cache, slots)
