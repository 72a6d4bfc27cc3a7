"""Helpers of the core tests: tiny tables and a snapshot of every observable piece of state.

The snapshot reads public attributes and methods only, so that it survives changes of the
internals; the order in which future allocations would hand out pages (the free stack and the
LRU order of cached pages) is read from a deep copy that allocates everything it can.
"""

import copy
from dataclasses import asdict
from typing import Any

import numpy as np

from service.core.allocator import PageAllocator
from service.core.hashing import page_hash, root_hash, token_bytes
from service.core.sequences import SequenceTable


def make_table(
    num_pages: int = 8,
    page_size: int = 4,
    prefix_caching: bool = True,
    max_pages_per_tenant: int = 0,
    content_names: bool = True,
) -> SequenceTable:
    """A small table; its pages named by their chained hashes unless content_names is False, so that
    tests can compare names with prefix_hashes()."""
    allocator = PageAllocator(num_pages, prefix_caching, content_names)
    return SequenceTable(allocator, page_size, max_pages_per_tenant)


def future_pages(allocator: PageAllocator) -> list[int]:
    """Every page the allocator can still hand out, in the order it would (on a copy)."""
    twin = copy.deepcopy(allocator)
    return twin.allocate(twin.num_available).tolist()


def snapshot(table: SequenceTable, tenants: tuple[str, ...] = ("",)) -> dict[str, Any]:
    """All state an operation may change; two equal snapshots mean nothing observable changed."""
    a = table.allocator
    stats = asdict(table.stats)
    stats.pop("allocation_failures")  # a failure is allowed (and meant) to count itself
    seqs = sorted(
        (
            s.tenant,
            s.seq_id,
            table.length(s),
            table.block_table(s),
            s.cached_tokens,
            None if s.tokens is None else list(s.tokens),
            s.last_name,
            table.tables[s.row].tolist(),
        )
        for s in table.sequences()
    )
    return {
        "counts": (a.num_used, a.num_cached, a.num_free, a.num_available, len(table)),
        "ref_count": a.ref_count.tolist(),
        "cached_pages": a.cached_pages(),
        "hashes": [a.page_name(p) for p in range(a.num_pages)],
        "evictions": a.num_evictions,
        "future_pages": future_pages(a),
        "sequences": seqs,
        "tenant_pages": [table.tenant_pages(t) for t in tenants],
        "table_shape": table.tables.shape,
        "stats": stats,
    }


def prefix_hashes(tokens: list[int], page_size: int, tenant: str = "") -> list[bytes]:
    """The chained hash of each full page of `tokens`, computed independently of the table."""
    out, parent = [], root_hash(tenant)
    for start in range(0, len(tokens) - len(tokens) % page_size, page_size):
        parent = page_hash(parent, token_bytes(tokens[start : start + page_size]))
        out.append(parent)
    return out


def ref_counts_from_tables(table: SequenceTable) -> np.ndarray:
    """How many block tables hold each page."""
    counts = np.zeros(table.allocator.num_pages, dtype=np.int64)
    for s in table.sequences():
        for page in table.block_table(s):
            counts[page] += 1
    return counts
