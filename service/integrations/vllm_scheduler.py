"""The scheduler side of KVPoolConnector (vllm.py): pins a new request's cached prefix, plans the steps and
commits what every rank has saved.

A new request's lookup creates its *pin* (vllm_lookup): a kvpool sequence whose block table is the cached
prefix, held until every rank has reported its loads from it (KVPoolWorkerMeta.loaded): a rank copies its pages
without asking kvpool again, having checked only that the pin was made on the instance whose pool it maps. The
hit answered is every token of that prefix but the prompt's last (vLLM computes at least one token): one call
per request, however many ranks load it.

Each step's plan (KVPoolMetadata) names the loads of the blocks just allocated for a hit and a save for every
request whose computed prompt filled more kvpool pages: a prompt prefilled in chunks (longer than the step's
token budget, or sharing it) is saved in one append with its last chunk, not one per chunk (each append is a
call to kvpool that the step waits for). That append is made by the lookup's create (vllm_reserve): the prompt's
save then needs no call at all. Pages filled while a request decodes ride on a
call made anyway (a prompt's save whose reservation failed, a finished request's save not reserved) until the
request finishes: what is left is appended then, its answer not waited for (vllm_reserve), and saved by the
next step (vLLM keeps its blocks until they are written). A decoding request thus makes
at most one call of its own, whatever its length, where it made one per page it filled. The scheduler appends
those pages itself, all of a step's in one call (vllm_saves): to the request's pin, to the sequence of its earlier saves
once every rank has written those, or else to a sequence created from its token ids (what kvpool holds already
is matched, not copied), so that every rank writes into the same pages: each rank its own KV heads (and
layers), vllm_worker. Each rank reports each save written or failed (KVPoolWorkerMeta, summed over the ranks
by vLLM's KVOutputAggregator). Once every rank has reported a save: when one could not write, the scheduler
releases its sequence uncommitted (`commit=false`); when all did, it commits the pages (the next step's call
lists the sequence, and the request's next save appends to it) and frees the sequence when the request
finishes, or frees it at once, committing, where the request cannot fill another page (its max_tokens). A page
thus enters the prefix cache only once all of its KV heads and layers are written, and its pages are never
released while a rank may still be writing them. A rank that dies never reports: its saves
stay uncommitted, and kvpool frees them when vLLM shuts the connector down (or holds them, if the engine dies
with them). A request given saves keeps its blocks after it finishes until every rank reports its saves done
(get_finished, summed the same way by vLLM).

Roles (vLLM's kv_role) and what a producer announces to a consumer's lookup: vllm_lookup.
"""

from collections import Counter
from functools import partial
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.core.sched.output import SchedulerOutput

from service.integrations.kvpool_link import KVPoolLink
from service.integrations.vllm_lookup import announced, announcement, look_up
from service.integrations.vllm_metadata import (
    Finishing,
    Held,
    KVPoolMetadata,
    KVPoolWorkerMeta,
    LoadJob,
    OpenSave,
    Pin,
    Role,
    SaveJob,
)
from service.integrations.vllm_releases import Releases
from service.integrations.vllm_reserve import Reservation, reserve
from service.integrations.vllm_saves import Append, Appended, append_all
from service.integrations.vllm_thread import ConnectorThread

Planned = tuple[str, int, tuple[str, int] | None]  # a save: request, its tokens [0, end) saved, (sequence, length)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


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
        self._held: dict[str, Held] = {}
        self._releases = Releases(link, thread, waits)  # the commits and frees waiting for a call
        self._finishing: dict[str, Finishing] = {}  # finished requests whose last pages the next step saves
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
        expected = announced(link, request.kv_transfer_params, len(token_ids))
        reserving = self._role.saves and self._role.reserve
        # (Where nothing is expected the create reserves, and carries no commits or frees: vllm_lookup.)
        commit, frees = self._releases.take() if reserving and expected else ([], [])
        wait_s = self._role.load_wait_s
        looked_up = self._thread.call(
            lambda: look_up(link, token_ids, salt, expected, wait_s, reserving, commit, frees)
        )
        if looked_up is None or looked_up[1] is None:
            self._releases.keep(commit, frees)  # (nothing carried them)
        if looked_up is None:
            return None
        info, reservation = looked_up
        if info.cached_tokens < expected:
            link.stats["load_wait_timeouts"] += 1
        hit = min(info.cached_tokens, len(token_ids) - 1)
        self._saved[request.request_id] = max(self._saved.get(request.request_id, 0), info.cached_tokens)
        # Kept even without a hit: the request's first save appends to it (build_connector_meta).
        pages = info.block_table[: -(-hit // link.page_size)]
        pin = Pin(info.seq_id, pages, hit, info.cached_tokens, info.instance_id or "", reserved=reservation)
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
                pin.instance_id,
            )
            self._loads.append(job)

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, manager: "KVCacheManager | None"
    ) -> KVConnectorMetadata:
        meta = KVPoolMetadata(loads=self._loads)
        self._loads = []
        for load in meta.loads:
            self._releases.loading(load.pin_id, self._num_ranks)
        meta.preempted = set(scheduler_output.preempted_req_ids or ())
        page_size = self._link.page_size
        if not page_size or not self._role.saves:
            self._releases.flush(bool(self._requests))
            return meta
        planned: list[Planned] = []
        block_ids: dict[str, list[int]] = {}
        held: dict[str, Held] = {}  # the held sequences this step's saves append to
        ready: list[tuple[str, Reservation]] = []  # saves into pages reserved ahead (vllm_reserve): no call

        def plan(req_id: str, end: int, blocks: list[int], reserved: Reservation | None) -> None:
            block_ids[req_id] = blocks[: -(-end // self._block_size)]
            if reserved is not None:
                ready.append((req_id, reserved))
            else:
                planned.append((req_id, end, self._base(req_id, held)))

        decoded: list[tuple[str, int]] = []  # pages filled by decoding: saved with a call made anyway
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None or manager is None:
                continue
            # The KV of tokens [0, computed) is in vLLM's blocks after this step; save whole pages of it.
            computed = min(request.num_computed_tokens + num_new, len(request.all_token_ids))
            if computed < request.num_prompt_tokens:
                continue  # a prefill chunk: saved with the prompt's last chunk, one append for all of them
            end = computed // page_size * page_size
            if end <= self._saved.get(req_id, 0):
                continue
            if request.num_computed_tokens >= request.num_prompt_tokens:
                decoded.append((req_id, end))  # (its block ids only if it goes: most steps it waits)
                continue
            self._saved[req_id] = end
            plan(req_id, end, list(manager.get_block_ids(req_id)[0]), self._reserved(req_id, end))
        finishing, self._finishing = self._finishing, {}
        meta.finish_saved = set(finishing)
        late = []  # finished requests whose last pages were not reserved: appended in this step
        for req_id, last in finishing.items():
            reserved = self._finish_reserved(req_id, last)
            if reserved is not None:
                plan(req_id, last.end, last.block_ids, reserved)
            else:
                late.append((req_id, last))
        if planned or late:
            for req_id, end in decoded:
                assert manager is not None  # (decoded only with one)
                self._saved[req_id] = end
                plan(req_id, end, list(manager.get_block_ids(req_id)[0]), None)
            for req_id, last in late:
                plan(req_id, last.end, last.block_ids, None)
        self._link.stats["saves"] += len(ready)
        for req_id, reserved in ready:
            self._open_save(meta, SaveJob(0, req_id, reserved.seq_id, reserved.instance_id, reserved.pages,
                                          reserved.start, reserved.end, block_ids[req_id]),
                            req_id not in finishing)  # fmt: skip
        if not planned:
            self._releases.flush(bool(self._requests))
            return meta
        commit, frees = self._releases.take()
        # The ranks need the pages before the forward: the step waits for the appends (one call for all of
        # them, with the commits of written saves and the frees of finished requests riding along; a create
        # first for a save with no sequence).
        kept = {h.seq_id for h in held.values()}
        requests = {req_id: self._requests.get(req_id) or finishing[req_id].request for req_id, _, _ in planned}
        appended = self._thread.call(lambda: self._append(planned, requests, commit, kept, frees))
        # (those that found no call to ride on: off the step, on the connector's thread)
        self._releases.flush(bool(self._requests))
        if appended is None:  # kvpool unusable now: no save this step; the held sequences stay held
            self._releases.keep(commit, [])
            for req_id, seq in held.items():
                if req_id in finishing:
                    self._releases.release(seq.seq_id)  # a finished request's: nothing appends to it any more
                else:
                    self._held[req_id] = seq
            return meta
        for done in appended:
            if done is None:
                continue
            item = done.item
            job = SaveJob(0, item.req_id, item.seq_id, done.instance_id, done.pages, item.start, item.end,
                          block_ids[item.req_id])  # fmt: skip
            self._open_save(meta, job, item.req_id not in finishing)
        return meta

    def _open_save(self, meta: KVPoolMetadata, job: SaveJob, running: bool) -> None:
        """A save handed to the ranks (numbered here), open until every rank has reported it."""
        job.save_id, self._next_save_id = self._next_save_id, self._next_save_id + 1
        self._open[job.save_id] = OpenSave(job.seq_id, job.end - job.start, job.req_id, job.end)
        meta.saves.append(job)
        if running:
            self._saving.add(job.req_id)

    def _reserved(self, req_id: str, end: int) -> Reservation | None:
        """The reservation made with the request's lookup, its pin taken for the save, if it holds exactly
        tokens [0, end). Otherwise the pin is left for _base as it was if kvpool refused the reservation, or
        released uncommitted (_usable)."""
        pin = self._pins.get(req_id)
        if pin is None or pin.reserved is None:
            return None
        reserved = pin.reserved
        usable = self._usable(reserved, end)
        if reserved.state == "refused":
            pin.reserved = None
            return None
        del self._pins[req_id]
        held = self._held.pop(req_id, None)
        if held is not None:  # (a preempted request looked up again)
            self._releases.release(held.seq_id)
        return reserved if usable else None

    def _finish_reserved(self, req_id: str, last: Finishing) -> Reservation | None:
        """The reservation made when the request finished, if it holds its last pages: its sequence (the
        request's pin or held one) taken for the save. Refused, the sequence is left for _base."""
        reserved = last.reserved
        if reserved is None:
            return None
        usable = self._usable(reserved, last.end)
        if reserved.state == "refused":
            return None
        self._pins.pop(req_id, None)
        self._held.pop(req_id, None)
        return reserved if usable else None

    def _usable(self, reserved: Reservation, end: int) -> bool:
        """Its answer read (it has long arrived): True if made for tokens [.., end). Lost, or made for other
        tokens (a preempted request's recompute), its sequence is released uncommitted (the save goes to a new
        one)."""
        if reserved.state == "sent":
            self._thread.call(self._link.client.settle)
        if reserved.state == "made" and reserved.end == end:
            return True
        if reserved.state != "refused":
            self._link.stats["reservations_unused"] += 1
            self._releases.release(reserved.seq_id, commit=False)
        return False

    def _base(self, req_id: str, taken: dict[str, Held]) -> tuple[str, int] | None:
        """The sequence a save of the request appends to and the tokens it holds: the request's pin (handed
        over: this step's loads from it run before the save, and its pages stay held), or the sequence of its
        last save once every rank has written that (appending commits those pages; put in `taken`); None: a
        new one."""
        pin, held = self._pins.pop(req_id, None), self._held.pop(req_id, None)
        if pin is not None:
            if held is not None:  # (a preempted request looked up again)
                self._releases.release(held.seq_id)
            return pin.seq_id, pin.cached
        if held is None:
            return None
        taken[req_id] = held
        return held.seq_id, held.end

    def _append(
        self,
        planned: list[Planned],
        requests: dict[str, "Request"],
        commit: list[str],
        kept: set[str],
        frees: list[str],
    ) -> list[Appended | None] | None:
        """On the connector's thread: the appends of the pages of tokens [kvpool's, end) of each request (None
        for a save with nothing to append, or that kvpool refused), `frees` freed in the same call (or, with
        no call to ride on, handed back to be sent at once without the step waiting); None when kvpool is not
        usable now (the pins are released once it answers again; the held sequences, `kept`, stay held)."""
        link = self._link
        if not link.usable():
            for _, _, base in planned:
                if base is not None and base[0] not in kept:  # a pin: released once kvpool answers again
                    self._releases.after_loads(base[0], partial(link.forget, base[0]))
            self._releases.hand_back(frees)
            return None
        items: list[Append] = []
        for req_id, end, base in planned:
            request = requests[req_id]
            if base is None:
                seq = link.create(list(request.all_token_ids[: end + 1]), request.cache_salt)
                if seq is None:
                    continue
                base = seq.seq_id, seq.cached_tokens
            seq_id, start = base
            if start >= end:  # kvpool holds these pages already (another engine saved them)
                link.free(seq_id)
                continue
            items.append(Append(req_id, seq_id, start, end, list(request.all_token_ids[start:end])))
        if not items:
            self._releases.hand_back(frees)
            return []
        return append_all(link, items, commit, frees)

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        """The ranks' reports of this step (summed over them): commit each save every rank has written."""
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, KVPoolWorkerMeta):
            return
        self.worker_stats.update(meta.stats)
        for pin_id, ranks in meta.loaded.items():  # (first: a save that follows a load reports no earlier)
            self._releases.loaded(pin_id, ranks)
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
                self._releases.release(save.seq_id, commit=False)
                continue
            self._link.stats["saved_tokens"] += save.tokens
            held = self._held.get(save.req_id)
            if save.req_id not in self._requests or (held is not None and held.end > save.end):
                self._releases.release(save.seq_id)  # finished, or a later save of it was reported first
                continue
            if held is not None:
                self._releases.release(held.seq_id)
            if self._fills_no_page(self._requests[save.req_id], save.end):
                # Nothing will append to it: freed now, the free committing its pages (one call, not a commit and a
                # free), by the next call (another request may look them up).
                self._releases.release(save.seq_id, at_once=True)
                continue
            # Held for the request's next save, which appends to it (committing its pages, if no call did before).
            self._held[save.req_id] = Held(save.seq_id, save.end)
            self._releases.commit(save.seq_id)

    def _fills_no_page(self, request: "Request", end: int) -> bool:
        """True if the request cannot fill another kvpool page past `end` before it ends: the most tokens it
        computes are its prompt and all of its max_tokens but the last (sampled, never computed)."""
        page_size = self._link.page_size
        most = request.num_prompt_tokens + (request.max_tokens or 1) - 1
        return bool(page_size) and most // page_size * page_size <= end

    def pending_saves(self) -> int:
        """Saves that not every rank has reported yet."""
        return len(self._open)

    def has_pending_push_work(self) -> bool:
        """Saves wait for their ranks' reports, and released sequences for the next step call that frees them:
        and so do finished requests' last pages for the step that saves them: an engine that would go idle keeps
        stepping until they are done."""
        return bool(self._open or self._releases.to_free or self._finishing)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._requests.pop(req_id, None)
        saved, page_size = self._saved.pop(req_id, 0), self._link.page_size
        end = request.num_computed_tokens // page_size * page_size if page_size and self._role.saves else 0
        if end > saved:
            # Pages its decoding filled since its last save: saved by the next step, appended now to its pin or
            # held sequence (vllm_reserve), or by that step (_base); vLLM keeps its blocks (`block_ids`: of its
            # computed tokens) until every rank has written them. Not later: blocks held keep requests waiting.
            reserved = self._reserve_finish(request, end)
            self._finishing[req_id] = Finishing(request, end, list(block_ids), reserved)
            self._link.stats["saves_after_finish"] += 1
            self._saving.discard(req_id)
            return True, announcement(self._link, self._role.saves, end)
        pin = self._pins.pop(req_id, None)
        if pin is not None:  # (if kvpool restarted meanwhile, the pin went with it)
            self._releases.release_pin(pin)
        held = self._held.pop(req_id, None)
        if held is not None:
            self._releases.release(held.seq_id)  # its pages are written: committed
        params = announcement(self._link, self._role.saves, saved)
        # A request given saves keeps its blocks until every rank's get_finished says they are copied.
        if req_id in self._saving:
            self._saving.discard(req_id)
            return True, params
        return False, params

    def _reserve_finish(self, request: "Request", end: int) -> Reservation | None:
        """A finished request's tokens [its sequence's, end) appended to its pin (one never reserved) or held
        sequence, the answer not waited for (vllm_reserve), the commits and frees riding along; None: nothing sent
        (the save appends in its step)."""
        req_id = request.request_id
        pin, held = self._pins.get(req_id), self._held.get(req_id)
        if not self._role.reserve or (pin is not None and (held is not None or pin.reserved is not None)):
            return None
        base = (pin.seq_id, pin.cached) if pin is not None else (held.seq_id, held.end) if held is not None else None
        if base is None or base[1] >= end:
            return None
        seq_id, start = base
        listed = seq_id in self._releases.to_commit  # (listed in the call anyway: what it held before is committed)
        self._releases.to_commit.discard(seq_id)
        commit, frees = self._releases.take()
        link, token_ids = self._link, request.all_token_ids
        reserved = self._thread.call(
            lambda: reserve(link, seq_id, token_ids, start, end, commit, frees) if link.usable() else None
        )
        if reserved is None:
            self._releases.keep([*commit, seq_id] if listed else commit, frees)
        return reserved

    def discard_open_saves(self) -> None:
        """At shutdown: saves not reported by every rank are released uncommitted (and pins whose loads were
        not reported, as asked)."""
        self._releases.shutdown()
        for save in self._open.values():
            self._releases.release(save.seq_id, commit=False)
        self._open.clear()
        for req_id, last in self._finishing.items():  # (their last pages may be appended: never written)
            if last.reserved is not None and last.reserved.unwritten:
                self._pins.pop(req_id, None)
                self._held.pop(req_id, None)
                self._releases.release(last.reserved.seq_id, commit=False)
        for held in self._held.values():
            self._releases.release(held.seq_id)  # written by every rank: committed
        self._held.clear()
        for pin in self._pins.values():  # (requests never saved into them; finishing ones' last pages unsaved)
            self._releases.release_pin(pin)
        self._pins.clear()
        self._finishing.clear()
        self._releases.flush(bool(self._requests), now=True)
