"""A new request's lookup in kvpool (the connector's scheduler side, vllm_scheduler), and what a producer's
response announces to the consumer's lookup.

The lookup creates a kvpool sequence from the request's token ids (the scheduler's *pin*): its block table is
the cached prefix, held (not evictable) until the request's first save, or until the request finishes or is
aborted, and in any case until every rank has reported its loads from it. The lookup sends one token more than
the prompt, so that kvpool, which never matches a prompt's last token, may match the page holding it; the loads
then end inside a vLLM block (vLLM allows a partial last block). Where the engine saves and reserves, the
prompt's full pages are appended to the pin by the create itself (`reserve_to`, vllm_reserve); a lookup that
waits for a producer appends them after its last create instead, in the same turn of the connector's thread,
the answer not waited for, with the commits and frees waiting for a call riding along.

Roles (vLLM's kv_role): a kv_producer only saves, a kv_consumer only loads, kv_both does both. A saving
engine's finished request carries kv_transfer_params {"kvpool_tokens": the tokens of it kvpool holds or a save
is writing, "kvpool_instance"}; a proxy that hands them to the consumer's request (as vLLM's
disaggregated-serving proxies do) makes the consumer's lookup wait, up to `load_wait_s`, until kvpool holds
that many of the prompt's tokens: the producer's saves land after its response, and a consumer that asked at
once would otherwise recompute the prompt (the producer never waits for its saves).
"""

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from service.integrations.kvpool_link import KVPoolLink
from service.integrations.vllm_reserve import Reservation, created_reservation, reserve

if TYPE_CHECKING:
    from service.client import SequenceInfo

LOAD_WAIT_POLL_S = 0.005  # a consumer's lookup asks kvpool again this often while it waits


def look_up(
    link: KVPoolLink,
    token_ids: Sequence[int],
    salt: str | None,
    expected: int,
    load_wait_s: float,
    reserving: bool,
    commit: list[str],
    frees: list[str],
) -> "tuple[SequenceInfo, Reservation | None] | None":
    """On the connector's thread: the pin of a prompt of `token_ids` (the sequence made from them and one token
    more), made once kvpool holds `expected` tokens of it or `load_wait_s` has passed, and, `reserving`, the
    reservation of the prompt's full pages: made by the create itself where nothing is `expected` (`commit` and
    `frees` must then be empty: the create carries none), else by a step of its own carrying `commit` and `frees`
    (None where it carried nothing: the caller keeps them). None when kvpool is not usable now."""
    if not link.usable():
        return None
    began = time.perf_counter_ns()
    # One token more: kvpool never matches a prompt's last token, and the page holding ours may be cached.
    # (Its id is never hashed: it starts a page of its own or ends a partial one.)
    lookup_ids = [*token_ids, token_ids[-1]]
    full = len(token_ids) // link.page_size * link.page_size  # what a reservation holds: the prompt's full pages
    in_create = reserving and not expected  # (one call where there were two: a round trip, and kvpool's time)
    deadline = time.monotonic() + load_wait_s
    info = link.create(lookup_ids, salt, full if in_create else None)
    # A producer's save still under way: wait, bounded, until kvpool holds what it announced.
    while info is not None and info.cached_tokens < expected and time.monotonic() < deadline:
        link.free(info.seq_id)  # holds only cached pages: the free commits nothing
        time.sleep(LOAD_WAIT_POLL_S)
        link.stats["load_wait_polls"] += 1
        info = link.create(lookup_ids, salt)
    reservation = None
    if info is not None and in_create:
        reservation = created_reservation(link, info, full)
    elif info is not None and reserving:  # the pages its save will write (the commits and frees ride along)
        reservation = reserve(link, info.seq_id, token_ids, info.cached_tokens, full, commit, frees)
    link.stats["lookups"] += 1  # one per request, however many ranks load it
    link.stats["lookup_ns"] += time.perf_counter_ns() - began  # the scheduler waits for it
    return None if info is None else (info, reservation)


def announcement(link: KVPoolLink, saves: bool, tokens: int) -> dict[str, Any] | None:
    """What a producer's response tells the consumer's request: the tokens kvpool holds or is being sent (full
    pages), and which kvpool; None where the engine does not save or holds nothing there."""
    if not (saves and tokens and link.instance_id):
        return None
    return {"kvpool_tokens": tokens, "kvpool_instance": link.instance_id}


def announced(link: KVPoolLink, params: dict[str, Any] | None, num_tokens: int) -> int:
    """Tokens of a prompt of `num_tokens` that a producer announced for this kvpool in the request's
    kv_transfer_params `params` (capped by what a lookup can match: full pages)."""
    params = params or {}
    tokens = params.get("kvpool_tokens")
    if not isinstance(tokens, int) or params.get("kvpool_instance") != link.instance_id:
        return 0
    page_size = link.page_size or 1
    return min(tokens, num_tokens) // page_size * page_size
