"""The sequences' side of the prefix cache: matching a new prompt against it, keeping each
sequence's token ids, and committing full pages once their K/V is written.

A row's leading num_hashed pages are committed; its tokens_known flag (and its Sequence.tokens, an
int64 array, or None) says whether every token id appended so far is known: an append without ids
ends the hashing of that sequence for good. A page is committed only once its data is known to be
written, which is the caller's to say (SequenceTable: data_written, the next append or step naming
the sequence, or free). Prefix hashes chain from a per-tenant root (service.core.hashing).
"""

from array import array

import numpy as np

from service.core.allocator import PageAllocator
from service.core.block_tables import BlockTables
from service.core.hashing import root_hash
from service.core.plan import Decode, OneRow, Rows, checked_token_bytes
from service.core.records import Sequence, TokenIds


class Prefixes:
    def __init__(self, allocator: PageAllocator, blocks: BlockTables, of_row: list[Sequence | None]) -> None:
        self.allocator = allocator
        self.blocks = blocks
        self.of_row = of_row  # the registry's list (grown in place): the sequence on each row
        self.page_size = blocks.page_size
        self._roots: dict[str, bytes] = {}

    def match(self, token_ids: TokenIds, tenant: str, cache_salt: str = "") -> tuple[list[int], bytes, "array[int]"]:
        """(cached pages starting the prompt, the name of the last one, the token ids they hold as
        int64); a hit never covers the last prompt token. The root hash is salted by the tenant and
        the cache salt; tenants' roots are memoised, salts (one per request, typically) are not."""
        if cache_salt:
            root = root_hash(tenant, cache_salt)
        else:
            root = self._roots.get(tenant) or self._roots.setdefault(tenant, root_hash(tenant))
        max_hits = (len(token_ids) - 1) // self.page_size
        tokens = array("q")
        if not self.allocator.enable_prefix_caching or max_hits <= 0:
            return [], root, tokens
        # Convert the first page alone: most prompts miss there, and then the rest needs no bytes.
        size, nbytes = self.page_size, self.page_size * 8
        first = checked_token_bytes(token_ids, 0, size)
        pages, last = self.allocator.match(root, first, nbytes)
        if pages:
            tokens.frombytes(first)  # little-endian int64, as array("q") is here
        if pages and max_hits > 1:
            rest = checked_token_bytes(token_ids, size, max_hits * size)
            more, last = self.allocator.match(last, rest, nbytes)
            pages += more
            with memoryview(rest) as view:
                tokens.frombytes(view[: len(more) * nbytes])
        return pages, last, tokens

    def num_cached(self, token_ids: list[int], tenant: str, cache_salt: str = "") -> int:
        """How many leading pages of the prompt match() would hit now, changing nothing (no pin, no
        LRU move, no counter)."""
        return len(self.match(token_ids, tenant, cache_salt)[0])

    def record(self, change: OneRow | Decode | Rows) -> None:
        """Keep the appended token ids; an append without them makes its sequence's unknown."""
        if isinstance(change, OneRow):
            self._record_one(self.of_row[change.row], change.data)  # type: ignore[arg-type]
            return
        rows, token_data = change.rows, change.token_data
        if change.known is None and token_data.count(None) == len(rows):
            return  # nothing known before or now (a decode step without ids, typically)
        for row, data in zip(rows.tolist(), token_data):
            self._record_one(self.of_row[row], data)

    def _record_one(self, seq: Sequence, data: bytes | None) -> None:
        if data is None:
            self.blocks.tokens_known[seq.row] = False
            seq.tokens = None
        elif seq.tokens is not None:
            seq.tokens.frombytes(data)

    def commit_changed(self, change: OneRow | Decode | Rows) -> None:
        """commit_rows() of the rows a change grows, up to their current lengths."""
        if not self.allocator.enable_prefix_caching:
            return
        if isinstance(change, OneRow):
            seq = self.of_row[change.row]
            self.commit_upto(seq, self.blocks.lengths.item(change.row) // self.page_size)  # type: ignore[arg-type]
        elif change.known is not None:
            self.commit_rows(change.rows, self.blocks.lengths[change.rows])

    def commit_rows(self, rows: np.ndarray, written: np.ndarray) -> None:
        """Commit every full page below `written` tokens of each row not committed yet."""
        if not self.allocator.enable_prefix_caching or len(rows) == 0:
            return
        b = self.blocks
        known = b.tokens_known[rows]
        if not known.any():
            return
        todo = np.nonzero(known & (written // self.page_size > b.num_hashed[rows]))[0]
        for i in todo.tolist():
            row = int(rows[i])
            self.commit_upto(self.of_row[row], int(written[i]) // self.page_size)  # type: ignore[arg-type]

    def commit_upto(self, seq: Sequence, num_full: int) -> None:
        """Commit the pages of `seq` below page num_full not committed yet (if its ids are known)."""
        if seq.tokens is None or not self.allocator.enable_prefix_caching:
            return
        row, size = seq.row, self.page_size
        start = self.blocks.num_hashed.item(row)
        if num_full <= start:
            return
        pages = self.blocks.tables[row, start:num_full]  # (uint32: the allocator takes a row's slice as it is)
        # A view, not a copy; released at once, since an array exporting a buffer cannot grow.
        with memoryview(seq.tokens) as ids, ids.cast("B") as data:
            seq.last_name = self.allocator.commit(
                pages, seq.last_name, data[start * size * 8 : num_full * size * 8], size * 8, start == 0
            )
        self.blocks.num_hashed[row] = num_full
