"""Scatter the K/V of T new tokens into their pool slots (slot = page * page_size + offset).

One program per (token, layer) copies that token's [H, D] K and V rows. A write whose slot is
negative or whose page is the null page (or past it) is skipped, as MAX's PagedKVCache.store
skips sentinel pages, so the null page stays all zeros and nothing lands past the pool.
"""

import torch
import triton
import triton.language as tl

from kernels.checks import as_index, check_blocks, check_devices, check_float, check_layer, next_pow2


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [L', T, H, D]
    v_ptr,  # [L', T, H, D]
    slots_ptr,  # [T]
    blocks_ptr,  # [N + 1, 2, L, P, H, D]
    first_layer,  # layer of k[0]
    num_pages,
    stride_k_layer,
    stride_k_token,
    stride_k_head,
    stride_v_layer,
    stride_v_token,
    stride_v_head,
    stride_blocks_page,
    stride_blocks_kv,
    stride_blocks_layer,
    stride_blocks_token,
    stride_blocks_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    layer_index = tl.program_id(1)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    page = slot // PAGE_SIZE
    if (slot < 0) | (page >= num_pages):
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < NUM_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    dst = (
        blocks_ptr
        + page * stride_blocks_page
        + (first_layer + layer_index).to(tl.int64) * stride_blocks_layer
        + (slot % PAGE_SIZE) * stride_blocks_token
        + h[:, None] * stride_blocks_head
        + d[None, :]
    )
    src_k = k_ptr + layer_index.to(tl.int64) * stride_k_layer + token.to(tl.int64) * stride_k_token
    src_v = v_ptr + layer_index.to(tl.int64) * stride_v_layer + token.to(tl.int64) * stride_v_token
    k = tl.load(src_k + h[:, None] * stride_k_head + d[None, :], mask=mask)
    v = tl.load(src_v + h[:, None] * stride_v_head + d[None, :], mask=mask)
    tl.store(dst, k.to(blocks_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_blocks_kv, v.to(blocks_ptr.dtype.element_ty), mask=mask)


def store_kv(
    blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, layer: int | None = None
) -> None:
    """k, v: [T, H, D] for one `layer`, or [L, T, H, D] for every layer when `layer` is None; slots: [T].

    Same contract as kernels.reference.store_kv_ref; values are rounded to the pool's dtype.
    """
    num_pages, num_layers, page_size, num_kv_heads, head_dim = check_blocks(blocks)
    if layer is None:
        check_float("k", k, (num_layers, None, num_kv_heads, head_dim))
        k4, v4, first_layer = k, v, 0
    else:
        check_layer(layer, num_layers)
        check_float("k", k, (None, num_kv_heads, head_dim))
        k4, v4, first_layer = k.unsqueeze(0), v.unsqueeze(0), layer
    check_float("v", v, tuple(k.shape))
    num_tokens = k4.shape[1]
    slots = as_index("slots", slots, 1, num_tokens)
    check_devices(blocks, k=k, v=v, slots=slots)
    if num_tokens == 0:
        return
    if k4.dtype != blocks.dtype:
        # Round to nearest in torch: Triton's interpreter truncates float32 -> bfloat16.
        k4, v4 = k4.to(blocks.dtype), v4.to(blocks.dtype)
    sb = blocks.stride()
    _store_kv_kernel[(num_tokens, k4.shape[0])](
        k4, v4, slots, blocks, first_layer, num_pages,
        k4.stride(0), k4.stride(1), k4.stride(2),
        v4.stride(0), v4.stride(1), v4.stride(2),
        sb[0], sb[1], sb[2], sb[3], sb[4],
        NUM_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 2048 else 1,
    )  # fmt: skip
