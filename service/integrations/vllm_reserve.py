"""A new request's prompt pages appended to its pin right after the lookup (a *reservation*), so that the step
that saves the prompt waits for no call to kvpool.

A prompt's save needs kvpool pages for its tokens [cached, its full pages) before the step's forward, so that
every rank writes into the same pages. Appended by that step, the step waited for the call: under load 2-10 ms
a request, a round trip waiting for a core (session 19's fleet runs, docs/fleet.md). The lookup knows those
tokens already: right after its create answers, the connector writes the append and goes on, and the answer
is read with the link's next call (vLLM computes the prompt meanwhile: by the step that saves it, the answer
has long arrived). The pages are appended without their K/V, so nothing may name the pin's sequence until
every rank has reported the save written (a step naming it commits them): the scheduler appends nothing
more to it before then, and releases a pin it never saved into uncommitted.

A reservation kvpool refuses (out of pages, over quota) leaves the pin as it was: the save appends then, as
without one. One whose answer is lost, or made for other tokens than the save's (a preempted request's
recompute), has its pin released uncommitted, and the save goes to a new sequence.
"""

from dataclasses import dataclass, field

import httpx

from service.client.calls import AppendResult, Calls
from service.core.errors import KVPoolError
from service.integrations.kvpool_link import KVPoolLink


@dataclass
class Reservation:
    """Tokens [0, end) of the request in its pin's sequence, once the append is made."""

    end: int
    state: str = "sent"  # "sent" (not answered yet), "made", "refused" (nothing appended), "lost" (it may have run)
    pages: list[int] = field(default_factory=list)  # the sequence's pages from token 0 through `end`, once made
    instance_id: str = ""

    @property
    def unwritten(self) -> bool:
        """The pin's sequence may hold pages without their K/V (released uncommitted, never committed)."""
        return self.state != "refused"


def reserve(link: KVPoolLink, seq_id: str, token_ids: list[int], start: int, end: int) -> Reservation | None:
    """On the link's thread, right after the create that made the pin `seq_id` (tokens [0, start)): tokens
    [start, end) of `token_ids` appended to it, the answer not waited for. None: nothing to reserve."""
    if end <= start:
        return None
    reservation = Reservation(end)

    def answered(outcome: AppendResult | KVPoolError | httpx.HTTPError) -> None:
        if isinstance(outcome, KVPoolError):  # (not a fault: the save appends then, and finds out)
            link.stats["reservations_refused"] += 1
            reservation.state = "refused"
        elif isinstance(outcome, httpx.HTTPError):
            link.record(outcome)
            reservation.state = "lost"
        else:
            reservation.pages, reservation.instance_id = outcome.block_table, outcome.instance_id or ""
            reservation.state = "made"  # (last: the scheduler's thread reads the state first)

    link.stats["reservations"] += 1
    try:
        link.client.send_unanswered(Calls.append(seq_id, None, token_ids[start:end], None, None, True), answered)
    except httpx.HTTPError as exc:  # (the request may have gone out in part)
        answered(exc)
    return reservation
