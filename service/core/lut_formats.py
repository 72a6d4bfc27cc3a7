"""Page tables in the formats other attention libraries read, built from kvpool's MAX-style LUT.

All three describe the same pages; only the encoding differs:
  max         lookup_table uint32 [B, lut_columns(max pages)], sentinel-filled past each row's pages,
              plus cache_lengths (tokens cached *before* this step's appends).
  flashinfer  CSR: kv_indptr int32 [B + 1], kv_indices int32 [nnz], kv_last_page_len int32 [B]
              (FlashInfer's BatchDecode/BatchPrefillWithPagedKVCacheWrapper.plan arguments).
  flash_attn  block_table int32 [B, max(1, max pages)], cache_seqlens int32 [B]
              (flash_attn_with_kvcache's paged arguments; lengths *after* this step's appends).

An empty sequence (length 0) has no pages: flashinfer gets indptr[i + 1] == indptr[i] and
last_page_len 0 (FlashInfer reads a request with no pages as length 0, whatever the last page
length); flash_attn gets a row of sentinels and cache_seqlens 0. Every other row has
last_page_len in [1, page_size].
"""

import numpy as np

FORMATS = ("max", "flashinfer", "flash_attn")


def pages_per_row(lengths: np.ndarray, page_size: int) -> np.ndarray:
    """int64 [B]: pages that hold `lengths` tokens."""
    return (lengths.astype(np.int64) + page_size - 1) // page_size


def flashinfer_tables(
    lookup_table: np.ndarray, lengths: np.ndarray, page_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kv_indptr [B+1], kv_indices [nnz], kv_last_page_len [B]), all int32.

    lookup_table: [B, cols] pages of each row; lengths: [B] tokens each row holds after the step.
    """
    num_pages = pages_per_row(lengths, page_size)
    if len(num_pages) and int(num_pages.max()) > lookup_table.shape[1]:
        raise ValueError("a row holds more pages than the lookup table has columns")
    indptr = np.zeros(len(num_pages) + 1, dtype=np.int64)
    np.cumsum(num_pages, out=indptr[1:])
    # Row-major mask of the first num_pages[i] columns picks the pages in order.
    keep = np.arange(lookup_table.shape[1])[None, :] < num_pages[:, None]
    indices = lookup_table[keep]
    last = lengths.astype(np.int64) - (num_pages - 1) * page_size
    last = np.where(num_pages > 0, last, 0)
    return indptr.astype(np.int32), indices.astype(np.int32), last.astype(np.int32)


def flash_attn_tables(lookup_table: np.ndarray, lengths: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(block_table [B, max(1, max pages)], cache_seqlens [B]), both int32.

    Columns past a row's pages keep the LUT's sentinel (the null page): a valid page index that
    flash_attn never reads, since it stops at cache_seqlens.
    """
    num_pages = pages_per_row(lengths, page_size)
    width = max(1, int(num_pages.max()) if len(num_pages) else 0)
    if width > lookup_table.shape[1]:
        raise ValueError("a row holds more pages than the lookup table has columns")
    block_table = np.ascontiguousarray(lookup_table[:, :width]).astype(np.int32)
    return block_table, lengths.astype(np.int32)
