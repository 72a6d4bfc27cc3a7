"""What the connector's scheduler (vllm_scheduler) gives back to kvpool: the sequences it releases, the
written saves it commits, and the pins it may not release yet.

None of it makes the step wait. A sequence released committing (its pages written by every rank, or
cached only) and a written save to commit wait for the next call the scheduler makes anyway (a step's
appends, a reservation: vllm_saves, vllm_reserve) and ride on it; those that find none within FREE_WAIT_S,
or once the engine has no request left, are sent in one call of their own on the connector's thread
(flush). A running request's save to commit most often rides on the append of its own last pages when it
finishes (which commits what its sequence held before): in a conversation, the pages are looked up by its
next round, which comes after the answer. The free of a save whose request cannot fill another page (it
has no later append of its own to ride on) goes with the next flush, as commits did until session 21. A
sequence released uncommitted (pages reserved or appended but never written) goes at once, on that thread.
A pin whose loads not every rank has reported stays held until they have: none of its pages is reused while
a rank copies from it.
"""

import math
import time
from collections import Counter
from collections.abc import Callable
from functools import partial

from service.integrations.kvpool_link import KVPoolLink
from service.integrations.vllm_metadata import Pin
from service.integrations.vllm_saves import free_all
from service.integrations.vllm_thread import ConnectorThread

# Frees and commits wait this long at most for a step call to ride on while the engine has requests (an engine
# with none sends them at once): a call of its own costs kvpool's server about what a step call does. Not
# longer: another request may look up the pages they commit (a burst sharing a new prefix, on another engine;
# commits waiting for their request's finish lost hits on the fleet's bench in session 19, and 1 s left as
# many calls of frees alone: most go when the engine has no request left).
FREE_WAIT_S = 0.25


class Releases:
    """The commits and frees waiting for a call, and the pins waiting for their ranks' loads."""

    def __init__(self, link: KVPoolLink, thread: ConnectorThread, waits: Counter[str]) -> None:
        self._link, self._thread, self._waits = link, thread, waits
        self.to_commit: set[str] = set()  # held sequences with written pages not committed yet (commit())
        self.to_free: list[str] = []  # sequences released (committing) since the last call: ride on the next
        self._since = 0.0  # when the oldest of both began to wait (monotonic)
        self.wait_s = FREE_WAIT_S
        # Pins whose loads not every rank has reported yet (rank reports to come), and what to do with each once
        # they have: a pin released meanwhile (its request finished or was aborted) stays held until then.
        self._loading: Counter[str] = Counter()
        self._deferred: dict[str, Callable[[], None]] = {}

    def loading(self, pin_id: str, ranks: int) -> None:
        """`ranks` reports of loads from the pin to come."""
        self._loading[pin_id] += ranks

    def loaded(self, pin_id: str, ranks: int) -> None:
        """`ranks` reports of loads from the pin came: once all have, what waited for them runs."""
        self._loading[pin_id] -= ranks
        if self._loading[pin_id] <= 0:
            del self._loading[pin_id]
            deferred = self._deferred.pop(pin_id, None)
            if deferred is not None:
                deferred()

    def after_loads(self, seq_id: str, action: Callable[[], None]) -> bool:
        """Defer `action` (releasing the pin `seq_id`) until every rank has reported its loads from it: True if
        deferred. Until then its pages stay held, so that none is reused while a rank copies from it."""
        if self._loading.get(seq_id, 0) <= 0:
            return False
        self._deferred[seq_id] = action
        return True

    def release(self, seq_id: str, commit: bool = True, at_once: bool = False) -> None:
        """Free a sequence: on a later call (its pages committed), the next the scheduler makes anyway or one of
        its own that flush sends (`at_once`: the next flush sends it, with whatever waits); commit=False: now, on
        the connector's thread, its pages not committed yet released uncommitted. vLLM's scheduler does not wait
        for either. A pin whose loads not every rank has reported is released once they have."""
        if self.after_loads(seq_id, partial(self.release, seq_id, commit, at_once)):
            return
        self.to_commit.discard(seq_id)
        if commit:
            self._waiting()
            if at_once:
                self._since = -math.inf  # (as if it had waited wait_s, whatever that is)
            self.to_free.append(seq_id)
        else:
            self._submit(lambda: self._link.discard(seq_id))

    def commit(self, seq_id: str) -> None:
        """Commit the written pages of a sequence kept held (a running request's save, which its next save or the
        append of its last pages commits, if no call did before): on a later call, as a free is sent."""
        self._waiting()
        self.to_commit.add(seq_id)

    def _waiting(self) -> None:
        if not (self.to_free or self.to_commit):
            self._since = time.monotonic()

    def release_pin(self, pin: Pin) -> None:
        """A pin never saved into: committing (it holds cached pages only), or uncommitted where pages were reserved
        in it (their K/V never written)."""
        self.release(pin.seq_id, commit=pin.reserved is None or not pin.reserved.unwritten)

    def take(self) -> tuple[list[str], list[str]]:
        """The commits and frees waiting for a call, taken for one."""
        commit, self.to_commit = list(self.to_commit), set()
        frees, self.to_free = self.to_free, []
        return commit, frees

    def keep(self, commit: list[str], frees: list[str]) -> None:
        """Commits and frees taken for a call not made: waiting again, as they were."""
        self.to_commit.update(commit)
        self.to_free[:0] = frees

    def hand_back(self, frees: list[str]) -> None:
        """Frees taken for a call that found nothing to send them with: the next flush sends them at once (they
        have waited)."""
        if frees:
            self.keep([], frees)
            self._since = -math.inf

    def flush(self, busy: bool, now: bool = False) -> None:
        """What waits, in one call of its own on the connector's thread (written, its answer read with the link's
        next call: free_all): when the engine is not `busy` (has no request left), when the oldest free or commit
        has waited `wait_s` (FREE_WAIT_S) for a call to ride on, or `now`."""
        if not (self.to_free or self.to_commit):
            return
        if now or not busy or time.monotonic() - self._since >= self.wait_s:
            commit, frees = self.take()
            self._submit(lambda: free_all(self._link, frees, commit))

    def shutdown(self) -> None:
        """At shutdown: loads never reported are taken as done (what waited for them runs)."""
        self._loading.clear()
        for deferred in list(self._deferred.values()):
            deferred()
        self._deferred.clear()

    def _submit(self, fn: Callable[[], None]) -> None:
        def release() -> None:
            began = time.perf_counter_ns()
            fn()
            self._link.stats["release_ns"] += time.perf_counter_ns() - began

        if self._thread.submit(release):
            self._waits["release_queue_full"] += 1
