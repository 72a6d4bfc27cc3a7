"""Pages appended to a request's sequence ahead of the step that saves into them (a *reservation*), so that no
step waits for a call to kvpool to save.

A save needs kvpool pages for its tokens before the step's forward, so that every rank writes into the same
pages. Appended by that step, the step waited for the call: under load 2-10 ms a request, a round trip waiting
for a core (session 19's fleet runs, docs/fleet.md). Two saves are known a step or more ahead:
- a new prompt's full pages, by its lookup's create itself (`reserve_to`: one call, where a create and a step
  cost two round trips and twice kvpool's handling; created_reservation), or right after it where the lookup
  waits for a producer's save (vLLM computes the prompt meanwhile);
- a finished request's last pages (those its decoding filled since its last save), when vLLM reports it finished:
  the next step saves them, its blocks kept until then.
Appended by a step of their own (reserve), the connector writes the append and goes on; the answer is read with
the link's next call (by the step that saves, it has long arrived). The pages are appended without their K/V, so
nothing may name the sequence until every rank has reported the save written (a step naming it commits them): the
scheduler appends nothing more to it before then, and releases one it never saved into uncommitted.

The scheduler's commits of written saves and frees of released sequences ride on a reservation's step (a `POST
/v1/step`: the append, the sequence and the commits listed, the frees; a listed row commits only what it held
before the step's appends), where each went in a call of its own. Refused whole (out of pages, over quota, a
sequence gone), nothing of it was applied: the reservation is left undone (the save appends in its step, as
without one) and the commits and frees go in a call of their own (vllm_saves.free_all). Lost (it may have run):
the sequence is released uncommitted, the save goes to a new one, and the frees are forgotten (freed uncommitted
once kvpool answers). Made for other tokens than the save's (a preempted request's recompute): as lost.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from service.client.calls import Calls, SequenceInfo, StepResult
from service.core.errors import KVPoolError
from service.integrations.kvpool_link import KVPoolLink
from service.integrations.vllm_saves import free_all


@dataclass
class Reservation:
    """Tokens [start, end) of a request appended to sequence `seq_id` (which held its tokens [0, start))."""

    seq_id: str
    start: int
    end: int
    state: str = "sent"  # "sent" (not answered yet), "made", "refused" (nothing appended), "lost" (it may have run)
    pages: list[int] = field(default_factory=list)  # the sequence's pages from token 0 through `end`, once made
    instance_id: str = ""

    @property
    def unwritten(self) -> bool:
        """The sequence may hold pages without their K/V (released uncommitted, never committed)."""
        return self.state != "refused"


def created_reservation(link: KVPoolLink, info: SequenceInfo, end: int) -> Reservation | None:
    """The reservation a lookup's create made with `reserve_to=end` (its answer in hand): made where the sequence
    reaches `end`, refused where kvpool lacked the pages (the sequence holds the cached prefix only); None where
    the cached prefix reaches `end` (nothing to reserve)."""
    start = info.cached_tokens
    if end <= start:
        return None
    link.stats["reservations"] += 1
    reservation = Reservation(info.seq_id, start, end)
    if info.length == start:  # (not a fault: the save appends then, and finds out)
        link.stats["reservations_refused"] += 1
        reservation.state = "refused"
    elif info.length == end:
        reservation.pages = info.block_table[: -(-end // link.page_size)]
        reservation.instance_id = info.instance_id or ""
        reservation.state = "made"
    else:  # neither: never written, released uncommitted (as a lost one)
        link.stats["internal_errors"] += 1
        reservation.state = "lost"
    return reservation


def reserve(
    link: KVPoolLink,
    seq_id: str,
    token_ids: Sequence[int],
    start: int,
    end: int,
    commit: Sequence[str] = (),
    free: Sequence[str] = (),
) -> Reservation | None:
    """On the link's thread: tokens [start, end) of `token_ids` appended to `seq_id` (holding [0, start)), the
    answer not waited for, with the sequences `commit` committed and `free` freed in the same call (neither may
    name `seq_id`). None, with nothing sent: nothing to reserve (the caller keeps its commits and frees)."""
    if end <= start:
        return None
    reservation = Reservation(seq_id, start, end)
    free = list(free)
    commit = list(commit)

    def answered(outcome: StepResult | KVPoolError | httpx.HTTPError) -> None:
        if isinstance(outcome, KVPoolError):  # (not a fault: the save appends then, and finds out)
            link.stats["reservations_refused"] += 1
            reservation.state = "refused"
            free_all(link, free, commit)  # (as if they had not ridden on it)
            return
        link.stats["frees"] += len(free)  # (sent, and applied unless lost)
        link.stats["commits"] += len(commit)
        if isinstance(outcome, StepResult) and int(outcome.cache_lengths[0]) != start:
            link.stats["internal_errors"] += 1  # not where the scheduler thought it: never written
        elif isinstance(outcome, StepResult):
            num_pages = -(-end // link.page_size)
            reservation.pages = outcome.lookup_table[0, :num_pages].tolist()
            reservation.instance_id = outcome.instance_id or ""
            reservation.state = "made"  # (last: the scheduler's thread reads the state first)
            return
        else:
            link.record(outcome)
            for freed in free:
                link.forget(freed)
        reservation.state = "lost"

    link.stats["reservations"] += 1
    call = Calls.step([(seq_id, end - start, list(token_ids[start:end]))], [seq_id, *commit], True, free)
    try:
        link.client.send_unanswered(call, answered)
    except httpx.HTTPError as exc:  # (the request may have gone out in part)
        answered(exc)
    return reservation
