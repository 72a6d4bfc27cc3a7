"""Lookup-table layout shared by the LUT builder and the kernels.

The sentinel of a pool of `num_pages` pages is `num_pages` itself: the index of the null page,
the extra last page of the pool that is never allocated and never written. Rows of a lookup table
are padded so that a kernel reading pages in vectors of up to 16 entries never reads past the row.
"""

LUT_COLUMN_ALIGN = 8
LUT_COLUMN_PAD = 16


def lut_columns(max_pages: int) -> int:
    """Columns of a lookup table whose longest row holds `max_pages` pages (MAX's rule)."""
    aligned = -(-max_pages // LUT_COLUMN_ALIGN) * LUT_COLUMN_ALIGN
    return aligned + LUT_COLUMN_PAD


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


# The pool holds one page more than it hands out: the null page, at index num_pages.
NUM_NULL_PAGES = 1
# Page ids (the sentinel included) stay below 2**31 - 1 (Settings.num_pages < 2**31 - 1), so a
# kernel may read a uint32 lookup table as int32 without changing any value.


def sentinel(num_pages: int) -> int:
    """The null page's index, which is also the value every lookup-table row is padded with."""
    return num_pages


def pages_in_pool(pool_pages: int) -> int:
    """num_pages of a pool tensor whose first dimension is `pool_pages` (the null page not counted)."""
    return pool_pages - NUM_NULL_PAGES
