"""@triton.jit helpers shared by the attention kernels: paged row addressing and the logit softcap."""

import triton
import triton.language as tl

# Attention runs in base 2 (exp2/log2); lse is returned in base e. constexpr: @triton.jit code may
# only read constexpr globals.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# The `window` the kernels get without a sliding window: wider than any context (< 2**30 tokens),
# so the window bounds need no branch.
NO_WINDOW = 2**30


@triton.jit
def _kv_row_offsets(
    lut_row_ptr,
    pos,
    kv_end,
    lut_cols,
    num_pages,
    stride_blocks_page,
    stride_blocks_token,
    PAGE_SIZE: tl.constexpr,
):
    """pos: [BLOCK_N] token positions of one sequence -> int64 offsets of their K rows in the pool.

    Positions at or past kv_end, LUT columns past the row, and LUT entries that are not a real
    page (the sentinel, or garbage) all resolve to the null page (index num_pages, the sentinel of
    service.core.layout), so no load ever leaves the pool.
    """
    page, token = _kv_pages(lut_row_ptr, pos, kv_end, lut_cols, num_pages, PAGE_SIZE)
    return page * stride_blocks_page + token * stride_blocks_token


@triton.jit
def _kv_pages(lut_row_ptr, pos, kv_end, lut_cols, num_pages, PAGE_SIZE: tl.constexpr):
    """pos: [BLOCK_N] -> (int64 page, int64 token within it), as _kv_row_offsets resolves them: for a kernel
    that addresses two tensors of the same pages (an FP8 pool's values and scales) from one LUT read."""
    col = pos // PAGE_SIZE
    page = tl.load(lut_row_ptr + col, mask=(pos < kv_end) & (col < lut_cols), other=num_pages)
    page = tl.where((page >= 0) & (page < num_pages), page, num_pages).to(tl.int64)
    return page, (pos % PAGE_SIZE).to(tl.int64)


@triton.jit
def _softcap(s, softcap):
    """softcap * tanh(s / softcap), through exp(-2|x|) so nothing overflows."""
    x = s / softcap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return softcap * tl.where(x < 0, -t, t)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot, or a float32 dot of the same (already rounded) operands where UPCAST: Triton 3.9's
    interpreter returns garbage for bfloat16 tl.dot, so CPU runs of bf16 pools take this path."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)
