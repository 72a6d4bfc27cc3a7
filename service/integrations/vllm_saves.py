"""The appends of one vLLM step's saves, in one call to kvpool (vllm_scheduler plans them; this runs on the
scheduler connector's thread while vLLM's step waits for the pages).

Every save appends the pages of its request's new tokens to a kvpool sequence before the forward, so that
every rank writes into the same pages. A step's saves go out together as one `POST /v1/step?instance=true`
(all appends or none; the answer names the instance whose pool the ranks must write into, and the lookup
table holds each sequence's pages). Sequences listed in `commit` ride along in the same call: a step's
listed rows commit their written pages (those of saves every rank has reported); so do the frees of the
sequences of finished requests (`free`: freed after the appends, committing). When kvpool refuses the step
(out of pages, over quota, a sequence gone) nothing of it was applied, and the saves are appended one call
each, so that one refused request leaves the others saved, and the frees follow one call each. A call whose
answer is lost may have run: its sequences are released uncommitted (the freed ones once kvpool answers).
"""

import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from service.client.calls import Calls, StepResult
from service.core.errors import KVPoolError
from service.integrations.kvpool_link import KVPoolLink


@dataclass
class Append:
    """Tokens [start, end) of a request (`token_ids`: those tokens) onto sequence `seq_id`, which holds its
    tokens [0, start)."""

    req_id: str
    seq_id: str
    start: int
    end: int
    token_ids: list[int]


@dataclass
class Appended:
    """An append made: the sequence's pages from token 0 (through `end`) on server `instance_id`."""

    item: Append
    pages: list[int]
    instance_id: str


def append_all(link: KVPoolLink, items: list[Append], commit: list[str], free: list[str]) -> list[Appended | None]:
    """The items appended, in order (None for one refused or lost: its sequence is released, committing only
    what was written before). `commit`: sequences whose pages are all written, committed in the same call;
    `free`: sequences freed in it (committing)."""
    began = time.perf_counter_ns()
    try:
        if len(items) > 1 or commit or free:
            out = _batched(link, items, commit, free)
        else:
            out = [_one(link, item) for item in items]
        link.stats["saves"] += sum(done is not None for done in out)
        return out
    finally:
        link.stats["append_ns"] += time.perf_counter_ns() - began  # the step waits for it


def free_all(link: KVPoolLink, free: list[str], commit: Sequence[str] = ()) -> None:
    """The sequences `free` freed, committing, and the written pages of `commit` committed, in one call (a step
    with nothing else) whose answer is not waited for: the request is written now and its answer read before the
    link's next call (the engine never needs it, and under load each round trip waited for a core). Refused (a
    sequence gone with a restart refuses the whole step): freed one call each then (the commits are left to
    the sequences' frees); lost: freed uncommitted once kvpool answers. Tried during an incident too (as out of
    pages: frees are what ends it)."""
    if not (free or commit):
        return

    def answered(outcome: StepResult | KVPoolError | httpx.HTTPError) -> None:
        if isinstance(outcome, StepResult):
            return
        link.record(outcome)
        if isinstance(outcome, KVPoolError):
            for seq_id in free:
                link.free(seq_id)
        else:
            for seq_id in free:
                link.forget(seq_id)

    try:
        link.client.send_unanswered(Calls.step([], commit, False, free), answered)
    except httpx.HTTPError as exc:  # (the request may have gone out in part)
        answered(exc)
        return
    link.stats["free_calls"] += 1
    link.stats["frees"] += len(free)
    link.stats["commits"] += len(commit)


def _batched(link: KVPoolLink, items: list[Append], commit: list[str], free: list[str]) -> list[Appended | None]:
    # (The scheduler frees a sequence once, never one it appends to or commits in the same call; were it
    # to, kvpool would refuse the step whole and the split below would carry on.)
    appended_ids = [item.seq_id for item in items]
    listed = appended_ids + [seq_id for seq_id in commit if seq_id not in set(appended_ids)]
    appends = [(item.seq_id, item.end - item.start, item.token_ids) for item in items]
    try:
        step = link.client.step(appends, listed, instance=True, free=free)
    except KVPoolError as exc:  # refused whole: nothing appended, committed or freed; one call each instead
        link.record(exc)
        link.stats["append_batches_split"] += 1
        each = [_one(link, item) for item in items]
        for seq_id in free:
            link.free(seq_id)
        return each
    except httpx.HTTPError as exc:  # it may have run: the appended pages are released uncommitted
        link.record(exc)
        for item in items:
            link.discard(item.seq_id)
        for seq_id in free:
            link.forget(seq_id)
        return [None] * len(items)
    link.stats["append_batches"] += 1
    link.stats["frees"] += len(free)
    assert step.instance_id is not None
    table, page_size = step.lookup_table, link.page_size
    out: list[Appended | None] = []
    for row, item in enumerate(items):
        if int(step.cache_lengths[row]) != item.start:  # not where the planner thought it: never written
            link.stats["internal_errors"] += 1
            link.discard(item.seq_id)
            out.append(None)
            continue
        num_pages = -(-item.end // page_size)
        out.append(Appended(item, table[row, :num_pages].tolist(), step.instance_id))
    return out


def _one(link: KVPoolLink, item: Append) -> Appended | None:
    try:
        appended = link.client.append(item.seq_id, token_ids=item.token_ids, instance=True)
    except KVPoolError as exc:  # refused whole (out of pages, quota): nothing was appended
        link.record(exc)
        link.free(item.seq_id)
        return None
    except httpx.HTTPError as exc:  # the append may have run: its pages are released uncommitted
        link.record(exc)
        link.discard(item.seq_id)
        return None
    assert appended.instance_id is not None
    return Appended(item, appended.block_table, appended.instance_id)
