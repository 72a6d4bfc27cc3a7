"""The scheduler side of KVPoolConnector (vllm.py): pins a new request's cached prefix and plans the steps.

A new request's token ids create a kvpool sequence (the *pin*): its block table is the cached prefix,
held (not evictable) until its first save, or until the request finishes or is aborted. The hit answered
is every token of that prefix but the prompt's last (vLLM computes at least one token): the lookup sends
one token more than the prompt, so that kvpool, which never matches a prompt's last token, may match the
page holding it; the loads then end inside a vLLM block (vLLM allows a partial last block). Each step's
plan (KVPoolMetadata) names the loads of the blocks just allocated for a hit and a save for every request
whose computed tokens filled more kvpool pages; a request given saves keeps its blocks after it finishes
until the worker side reports them done.

Roles (vLLM's kv_role): a kv_producer only saves, a kv_consumer only loads, kv_both does both. A saving
engine's finished request carries kv_transfer_params {"kvpool_tokens": the tokens of it kvpool holds or
a queued save is writing, "kvpool_instance"}; a proxy that hands them to the consumer's request (as vLLM's
disaggregated-serving proxies do) makes the consumer's lookup wait, up to `load_wait_s`, until kvpool
holds that many of the prompt's tokens: the producer's saves land after its response, and a consumer
that asked at once would otherwise recompute the prompt (the producer never waits for its saves).
"""

import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.core.sched.output import SchedulerOutput

from service.integrations.kvpool_link import KVPoolLink
from service.integrations.vllm_metadata import KVPoolMetadata, LoadJob, Pin, Role, SaveJob
from service.integrations.vllm_thread import WorkerThread

LOAD_WAIT_POLL_S = 0.005  # a consumer's lookup asks kvpool again this often while it waits

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.request import Request

    from service.client import SequenceInfo


class KVPoolConnectorScheduler:
    """The scheduler role's state: its requests, their pins and what of each kvpool holds or is saving."""

    def __init__(
        self,
        link: KVPoolLink,
        thread: WorkerThread,
        waits: Counter[str],
        block_size: int,
        role: Role,
    ) -> None:
        self._link, self._thread, self._waits, self._block_size = link, thread, waits, block_size
        self._role = role
        self._requests: dict[str, Request] = {}
        self._pins: dict[str, Pin] = {}
        self._saved: dict[str, int] = {}  # tokens of each request kvpool holds or a save is under way for
        self._loads: list[LoadJob] = []
        self._saving: set[str] = set()  # requests given a save: vLLM keeps their blocks until it is done

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
        page_size = self._link.page_size
        if not page_size or manager is None or not self._role.saves:
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
        params = self._announcement(self._saved.pop(req_id, 0))
        # A request given saves keeps its blocks until the worker's get_finished says they are copied.
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

    def _release(self, seq_id: str) -> None:
        """Free a pin on the connector's thread; vLLM's scheduler does not wait for it."""

        def release() -> None:
            began = time.perf_counter_ns()
            self._link.free(seq_id)
            self._link.stats["release_ns"] += time.perf_counter_ns() - began

        if self._thread.submit(release):
            self._waits["release_queue_full"] += 1
