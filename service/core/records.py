"""The records the core hands out: sequences, what an append changed, a step's result, counters."""

from array import array
from collections import abc
from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np

from service.core import page_ops


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: str
    tenant: str
    row: int
    # Token ids so far as int64 (converted once, on arrival); None once an append came without
    # token ids: the sequence's later pages are never hashed.
    tokens: "array[int] | None"
    last_name: bytes  # name of the last committed page (the chain root before the first)
    cached_tokens: int = 0
    ttl_s: float = 0.0
    expires_at: float = 0.0


class Extension:
    """What one append (or the appends of one step) changed on the device side.

    slots: int64 [total new tokens], sequences in order; slots[offsets[i]:offsets[i+1]] belong to
    the i-th sequence. copies: (src page, dst page) copy-on-write copies to do before writing.
    A one-row append gives the pages its tokens landed on instead of the slots (`pages` as uint32
    bytes, the position of its first token within pages[0], the page size), and the slots are numbered when
    first read: a caller that only allocates (an engine computing its own slot mapping, as vLLM's
    does) never pays for them, 4,096 of them costing more than the allocation.
    """

    __slots__ = ("_page_size", "_pages", "_slots", "_start", "copies", "offsets")

    def __init__(
        self,
        slots: np.ndarray | None,
        offsets: abc.Sequence[int],
        copies: list[tuple[int, int]],
        pages: bytes = b"",
        start: int = 0,
        page_size: int = 0,
    ) -> None:
        self._slots, self.offsets, self.copies = slots, offsets, copies
        self._pages, self._start, self._page_size = pages, start, page_size

    @property
    def slots(self) -> np.ndarray:
        if self._slots is None:
            self._slots = np.empty(self.offsets[-1], dtype=np.int64)
            pages = np.frombuffer(self._pages, dtype=np.uint32).copy()  # (the compiled loop takes writable buffers)
            page_ops.page_slots(pages, self._start, self._page_size, self._slots)
        return self._slots


@dataclass(slots=True)
class StepResult:
    seq_ids: list[str]
    lookup_table: np.ndarray  # uint32 [batch, lut_columns(max pages)]
    cache_lengths: np.ndarray  # uint32 [batch], lengths before this step's appends
    input_lengths: list[int]
    new_slots: np.ndarray  # int64 [sum(input_lengths)]: the new slots of seq_ids[0], then seq_ids[1], ...
    copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def one_token_each(self) -> bool:
        """A decode step: every listed sequence appended exactly one token (slots = new_slots as [n, 1])."""
        return self.input_lengths.count(1) == len(self.input_lengths)

    @property
    def slots(self) -> list[list[int]]:
        """new_slots per sequence: slots[i] are those of seq_ids[i] (empty when it appended nothing).
        Built on demand: a decode step's 256 one-element lists cost as much as the rest of it."""
        if self.one_token_each:
            return self.new_slots.reshape(-1, 1).tolist()
        flat, out, start = self.new_slots.tolist(), [], 0
        for count in self.input_lengths:
            out.append(flat[start : start + count])
            start += count
        return out


@dataclass(slots=True)
class Stats:
    tokens_appended: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    allocation_failures: int = 0
    sequences_expired: int = 0


Append = tuple[str, int, "list[int] | None"]  # (seq_id, num_tokens, token_ids)
# Token ids in process: a list of ints, or a 1-D numpy integer array (create and append; converted
# to int64 bytes as a block, without a Python loop).
TokenIds: TypeAlias = list[int] | np.ndarray
