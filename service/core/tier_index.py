"""The bookkeeping of a lower tier (host memory, a disk file): which slot holds which page, LRU.

A tier has `num_slots` slots of one page each. Every slot is in exactly one place: free, or held by
one entry keyed by the page's chained hash (service.core.hashing). An entry also keeps the page's
key (parent hash || token bytes, the prefix index's key), so a lookup compares the full preimage and
a digest collision can never return the wrong page, as in the device's prefix index.

An entry is `pending` from reserve() until its data is in the slot (ready()): lookups skip it, so a
read is never issued for a slot whose write has not landed. Reserving when no slot is free evicts the
least recently used entries (pending ones too: their write lands in a slot nobody looks up any more,
or is overwritten later, since the tier's writes run in the order they were reserved).

Pure bookkeeping (stdlib + numpy): the copies are the caller's (service/tiers/).
"""

import hashlib
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class TierEntry:
    slot: int
    key: bytes  # parent hash (32 bytes) || the page's token ids as int64 bytes
    pending: bool = True


class TierIndex:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError("num_slots must be >= 0")
        self.num_slots = num_slots
        self._entries: OrderedDict[bytes, TierEntry] = OrderedDict()  # oldest use first
        # Popped from the end: num_slots - 1 first, then down. An eviction hands over a prefix's pages
        # tail first (the LRU order), so its pages land in ascending slots, and a restore of the prefix
        # reads runs of consecutive slots into runs of consecutive pages: one copy per run.
        self._free = list(range(num_slots))
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, page_hash: bytes) -> bool:
        return page_hash in self._entries

    @property
    def num_free(self) -> int:
        return len(self._free)

    def entry(self, page_hash: bytes) -> TierEntry | None:
        return self._entries.get(page_hash)

    def slots(self) -> dict[bytes, int]:
        """{hash: slot} of every entry, oldest use first (for tests and invariants)."""
        return {h: e.slot for h, e in self._entries.items()}

    def reserve(
        self, page_hash: bytes, key: bytes, evicted_ready: list[bytes] | None = None
    ) -> tuple[int, list[bytes]] | None:
        """A slot for the page `page_hash` (pending until ready()), evicting the oldest entries if no
        slot is free; returns (slot, evicted hashes), or None if the page is already here (its entry
        is then the most recently used) or the tier has no slot at all. The hashes of evicted entries
        that were ready (that lookups could see: KV events told of them) are appended to
        `evicted_ready` when given."""
        if page_hash in self._entries:
            self._entries.move_to_end(page_hash)
            return None
        if self.num_slots == 0:
            return None
        evicted = []
        if not self._free:
            old_hash, old = self._entries.popitem(last=False)
            self._free.append(old.slot)
            evicted.append(old_hash)
            if evicted_ready is not None and not old.pending:
                evicted_ready.append(old_hash)
            self.num_evictions += 1
        slot = self._free.pop()
        self._entries[page_hash] = TierEntry(slot, key)
        return slot, evicted

    def ready(self, page_hash: bytes, slot: int) -> bool:
        """The data of `page_hash` is in `slot` now: lookups may return it. False if the entry went
        (evicted, or discarded) or moved meanwhile."""
        entry = self._entries.get(page_hash)
        if entry is None or entry.slot != slot:
            return False
        entry.pending = False
        return True

    def discard(self, page_hash: bytes, slot: int | None = None) -> bool:
        """Drop the entry of `page_hash` (only if it holds `slot`, when given): its write failed or
        its data was found wrong. Its slot is free again."""
        entry = self._entries.get(page_hash)
        if entry is None or (slot is not None and entry.slot != slot):
            return False
        del self._entries[page_hash]
        self._free.append(entry.slot)
        return True

    def match(
        self, parent: bytes, data: bytes, page_nbytes: int, limit: int | None = None, touch: bool = True
    ) -> list[tuple[bytes, int]]:
        """The ready entries continuing the chain from `parent` over the full pages of `data` (token
        bytes), up to `limit` pages: [(hash, slot)], stopping at the first page not here. Each found
        entry becomes the most recently used, unless `touch` is False (a peek: POST /v1/prefix/match)."""
        found: list[tuple[bytes, int]] = []
        num = len(data) // page_nbytes if limit is None else min(limit, len(data) // page_nbytes)
        for i in range(num):
            key = parent + data[i * page_nbytes : (i + 1) * page_nbytes]
            page_hash = hashlib.sha256(key).digest()
            entry = self._entries.get(page_hash)
            if entry is None or entry.pending or entry.key != key:
                break
            if touch:
                self._entries.move_to_end(page_hash)
            found.append((page_hash, entry.slot))
            parent = page_hash
        return found

    def check(self) -> None:
        """Invariants: every slot free or held by exactly one entry."""
        held = [e.slot for e in self._entries.values()]
        assert len(set(held)) == len(held), "a slot held twice"
        assert not set(held) & set(self._free), "a slot both free and held"
        assert sorted(held + self._free) == list(range(self.num_slots)), "slots lost or invented"


def chain_hashes(parent: bytes, data: bytes, page_nbytes: int, limit: int | None = None) -> list[bytes]:
    """The chained hashes of the full pages of `data` (token bytes) after `parent`, up to `limit`."""
    num = len(data) // page_nbytes if limit is None else min(limit, len(data) // page_nbytes)
    out = []
    for i in range(num):
        parent = hashlib.sha256(parent + data[i * page_nbytes : (i + 1) * page_nbytes]).digest()
        out.append(parent)
    return out
