"""The worker side of KVPoolConnector (vllm.py): copies K/V between vLLM's blocks and kvpool's mapped pool.

Before the forward, the step's loads copy the pinned pages into vLLM's blocks (and check that the pin
still lives on the mapped server; else the blocks are reported as load errors). After the forward, the
step's saves are queued on the connector's thread and the step goes on: each appends to the request's pin
or to a new sequence, copies the K/V into the appended pages and frees the sequence, which commits them
(_save, _write: the checks that the pool written is the server's). get_finished reports the finished
requests whose saves are done; handle_preemptions lets the saves of preempted requests finish first.
"""

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import httpx
import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.model_executor.models.utils import extract_layer_index

from service.core.errors import KVPoolError
from service.integrations.kvpool_link import KVPoolLink
from service.integrations.vllm_copy import KVCopier, Writer
from service.integrations.vllm_layout import Layout, check_layout
from service.integrations.vllm_metadata import Job, KVPoolMetadata, LoadJob, SaveJob
from service.integrations.vllm_thread import WorkerThread

logger = logging.getLogger("service.integrations.vllm")


class KVPoolConnectorWorker:
    """The worker role's state: vLLM's KV caches, this step's load errors, and the saves under way."""

    def __init__(
        self, vllm_config: VllmConfig, link: KVPoolLink, thread: WorkerThread, waits: Counter[str], block_size: int
    ) -> None:
        self._vllm_config = vllm_config
        self._link, self._thread, self._waits, self._block_size = link, thread, waits, block_size
        # Layer index -> its KV cache [num_blocks, heads, block_size, 2 * head_dim], and the attention
        # backend's writer into it (what loads store K/V with).
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

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
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


def _write_layer(layer: Any, cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """Store K/V [T, H, D] at `slots` of one layer's cache with its attention backend's own writer."""
    layer.impl.do_kv_cache_update(layer, key, value, cache, slots)
