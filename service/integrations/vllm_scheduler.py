"""The scheduler side of KVPoolConnector (vllm.py): pins a new request's cached prefix, plans the steps and
commits what every rank has saved.

A new request's token ids create a kvpool sequence (the *pin*): its block table is the cached prefix,
held (not evictable) until its first save, or until the request finishes or is aborted. The hit answered
is every token of that prefix but the prompt's last (vLLM computes at least one token): one call per
request, however many ranks load it. The lookup sends one token more than the prompt, so that kvpool, which
never matches a prompt's last token, may match the page holding it; the loads then end inside a vLLM block
(vLLM allows a partial last block).

Each step's plan (KVPoolMetadata) names the loads of the blocks just allocated for a hit and a save for
every request whose computed tokens filled more kvpool pages. The scheduler appends those pages itself
(to the request's pin, or to a sequence created from its token ids for a later save: what kvpool holds
already is matched, not copied), so that every rank writes into the same pages: each rank its own KV
heads (and layers), vllm_worker. Each rank reports each save written or failed (KVPoolWorkerMeta, summed
over the ranks by vLLM's KVOutputAggregator), and once every rank has reported a save, the scheduler frees
its sequence: committing its pages to kvpool's prefix cache when every rank wrote its part, releasing them
uncommitted (`commit=false`) when one could not. A page thus enters the prefix cache only once all of its
KV heads and layers are written, and its pages are never released while a rank may still be writing them.
A rank that dies never reports: its saves stay uncommitted, and kvpool frees them when vLLM shuts the
connector down (or holds them, if the engine dies with them). A request given saves keeps its blocks after
it finishes until every rank reports its saves done (get_finished, summed the same way by vLLM).

Roles (vLLM's kv_role): a kv_producer only saves, a kv_consumer only loads, kv_both does both. A saving
engine's finished request carries kv_transfer_params {"kvpool_tokens": the tokens of it kvpool holds or
a save is writing, "kvpool_instance"}; a proxy that hands them to the consumer's request (as vLLM's
disaggregated-serving proxies do) makes the consumer's lookup wait, up to `load_wait_s`, until kvpool
holds that many of the prompt's tokens: the producer's saves land after its response, and a consumer
that asked at once would otherwise recompute the prompt (the producer never waits for its saves).
"""

import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.core.sched.output import SchedulerOutput

from service.core.errors import KVPoolError
from service.integrations.kvpool_link import KVPoolLink
from service.integrations.vllm_metadata import KVPoolMetadata, KVPoolWorkerMeta, LoadJob, Pin, Role, SaveJob
from service.integrations.vllm_thread import ConnectorThread

LOAD_WAIT_POLL_S = 0.005  # a consumer's lookup asks kvpool again this often while it waits

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from service.client import SequenceInfo


@dataclass
class OpenSave:
    """A save whose ranks have not all reported yet: its sequence holds the appended pages, uncommitted."""

    seq_id: str
    tokens: int  # tokens appended (committed once every rank has written them)
    written: int = 0  # ranks that wrote their part
    failed: int = 0  # ranks that could not


class KVPoolConnectorScheduler:
    """The scheduler role's state: its requests, their pins, what of each kvpool holds or is saving, and the
    saves waiting for their ranks."""

    def __init__(
        self,
        link: KVPoolLink,
        thread: ConnectorThread,
        waits: Counter[str],
        block_size: int,
        num_ranks: int,
        role: Role,
    ) -> None:
        self._link, self._thread, self._waits, self._block_size = link, thread, waits, block_size
        self._role = role
        self._num_ranks = num_ranks  # the workers that write and report each save (tensor x pipeline parallel)
        self._requests: dict[str, Request] = {}
        self._pins: dict[str, Pin] = {}
        self._saved: dict[str, int] = {}  # tokens of each request kvpool holds or a save is under way for
        self._loads: list[LoadJob] = []
        self._saving: set[str] = set()  # requests given a save: vLLM keeps their blocks until it is done
        self._open: dict[int, OpenSave] = {}
        self._next_save_id = 0
        self.worker_stats: Counter[str] = Counter()  # the workers' counters, summed over the ranks

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        self._requests[request.request_id] = request
        if not self._role.loads:
            return 0, False
        pin = self._pins.get(request.request_id)
        if pin is None:
            pin = self._pin(request)
            if pin is None:
                return 0, False
        pin.start = num_computed_tokens
        return max(0, pin.hit - num_computed_tokens), False

    def _pin(self, request: "Request") -> Pin | None:
        link, token_ids, salt = self._link, list(request.all_token_ids), request.cache_salt
        # One token more: kvpool never matches a prompt's last token, and the page holding ours may be cached.
        # (Its id is never hashed: it starts a page of its own or ends a partial one.)
        lookup_ids = [*token_ids, token_ids[-1]]
        expected = self._announced(request, len(token_ids))

        def lookup() -> "SequenceInfo | None":
            if not link.usable():
                return None
            began = time.perf_counter_ns()
            deadline = time.monotonic() + self._role.load_wait_s
            info = link.create(lookup_ids, salt)
            # A producer's save still under way: wait, bounded, until kvpool holds what it announced.
            while info is not None and info.cached_tokens < expected and time.monotonic() < deadline:
                link.free(info.seq_id)  # holds only cached pages: the free commits nothing
                time.sleep(LOAD_WAIT_POLL_S)
                link.stats["load_wait_polls"] += 1
                info = link.create(lookup_ids, salt)
            link.stats["lookups"] += 1  # one per request, however many ranks load it
            link.stats["lookup_ns"] += time.perf_counter_ns() - began  # the scheduler waits for it
            return info

        info = self._thread.run(lookup)
        if info is None:
            return None
        if info.cached_tokens < expected:
            link.stats["load_wait_timeouts"] += 1
        hit = min(info.cached_tokens, len(token_ids) - 1)
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

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, manager: "KVCacheManager | None"
    ) -> KVConnectorMetadata:
        meta = KVPoolMetadata(loads=self._loads)
        self._loads = []
        meta.preempted = set(scheduler_output.preempted_req_ids or ())
        page_size = self._link.page_size
        if not page_size or manager is None or not self._role.saves:
            return meta
        planned: list[tuple[str, int, list[int], Pin | None]] = []
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
            block_ids = list(manager.get_block_ids(req_id)[0])[: -(-end // self._block_size)]
            # The pin is handed over: this step's loads from it run before the save, and its pages stay held.
            planned.append((req_id, end, block_ids, self._pins.pop(req_id, None)))
        if planned:
            # The ranks need the pages before the forward: the step waits for the appends (one call per
            # request, two for a request's later saves).
            meta.saves = self._thread.run(lambda: [job for p in planned if (job := self._append(*p)) is not None])
            self._saving.update(job.req_id for job in meta.saves)
        return meta

    def _append(self, req_id: str, end: int, block_ids: list[int], pin: Pin | None) -> SaveJob | None:
        """Append the pages of tokens [kvpool's, end) of the request to its pin or a new sequence (on the
        connector's thread); the save that writes them, or None (nothing to save, or kvpool failed)."""
        link, request = self._link, self._requests[req_id]
        if not link.usable():
            if pin is not None:
                link.forget(pin.seq_id)  # released once kvpool answers again
            return None
        if pin is not None:
            seq_id, start = pin.seq_id, pin.cached
        else:
            seq = link.create(list(request.all_token_ids[: end + 1]), request.cache_salt)
            if seq is None:
                return None
            seq_id, start = seq.seq_id, seq.cached_tokens
        if start >= end:  # kvpool holds these pages already (another engine saved them)
            link.free(seq_id)
            return None
        began = time.perf_counter_ns()
        try:
            appended = link.client.append(seq_id, token_ids=list(request.all_token_ids[start:end]), instance=True)
        except KVPoolError as exc:  # refused whole (out of pages, quota): nothing was appended
            link.record(exc)
            link.free(seq_id)
            return None
        except httpx.HTTPError as exc:  # the append may have run: its pages are released uncommitted
            link.record(exc)
            link.discard(seq_id)
            return None
        finally:
            link.stats["append_ns"] += time.perf_counter_ns() - began
        assert appended.instance_id is not None
        save_id, self._next_save_id = self._next_save_id, self._next_save_id + 1
        self._open[save_id] = OpenSave(seq_id, end - start)
        return SaveJob(save_id, req_id, seq_id, appended.instance_id, appended.block_table, start, end, block_ids)

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        """The ranks' reports of this step (summed over them): commit each save every rank has written."""
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, KVPoolWorkerMeta):
            return
        self.worker_stats.update(meta.stats)
        for save_id in set(meta.written) | set(meta.failed):
            save = self._open.get(save_id)
            if save is None:
                continue
            save.written += meta.written[save_id]
            save.failed += meta.failed[save_id]
            if save.written + save.failed < self._num_ranks:
                continue
            del self._open[save_id]
            if save.failed:
                self._link.stats["saves_discarded"] += 1
            else:
                self._link.stats["saved_tokens"] += save.tokens
            self._release(save.seq_id, commit=not save.failed)

    def pending_saves(self) -> int:
        """Saves that not every rank has reported yet."""
        return len(self._open)

    def has_pending_push_work(self) -> bool:
        """Saves wait for their ranks' reports: an engine that would go idle keeps stepping until they come."""
        return bool(self._open)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        pin = self._pins.pop(req_id, None)
        if pin is not None:
            self._release(pin.seq_id)  # if kvpool restarted meanwhile, the pin went with it
        self._requests.pop(req_id, None)
        params = self._announcement(self._saved.pop(req_id, 0))
        # A request given saves keeps its blocks until every rank's get_finished says they are copied.
        if req_id in self._saving:
            self._saving.discard(req_id)
            return True, params
        return False, params

    def _announcement(self, tokens: int) -> dict[str, Any] | None:
        """What a producer's response tells the consumer's request: the tokens kvpool holds or is being
        sent (full pages), and which kvpool."""
        if not (self._role.saves and tokens and self._link.instance_id):
            return None
        return {"kvpool_tokens": tokens, "kvpool_instance": self._link.instance_id}

    def _announced(self, request: "Request", num_tokens: int) -> int:
        """Tokens of this prompt a producer announced for this kvpool (capped by what a lookup can match)."""
        params = request.kv_transfer_params or {}
        tokens = params.get("kvpool_tokens")
        if not isinstance(tokens, int) or params.get("kvpool_instance") != self._link.instance_id:
            return 0
        page_size = self._link.page_size or 1
        return min(tokens, num_tokens) // page_size * page_size

    def discard_open_saves(self) -> None:
        """At shutdown: saves not reported by every rank are released uncommitted."""
        for save in self._open.values():
            self._release(save.seq_id, commit=False)
        self._open.clear()

    def _release(self, seq_id: str, commit: bool = True) -> None:
        """Free a sequence on the connector's thread; vLLM's scheduler does not wait for it. commit=False:
        its pages not committed yet are released uncommitted."""

        def release() -> None:
            began = time.perf_counter_ns()
            if commit:
                self._link.free(seq_id)
            else:
                self._link.discard(seq_id)
            self._link.stats["release_ns"] += time.perf_counter_ns() - began

        if self._thread.submit(release):
            self._waits["release_queue_full"] += 1
