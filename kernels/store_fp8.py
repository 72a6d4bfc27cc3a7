"""Quantize K/V to FP8 (e4m3) with per-group scales and write them into their slots.

One program per (token, layer, KV head) quantizes that head's K and V: per group of g channels,
scale = amax / 448 (rounded to the scale dtype), fp8 = RNE(x / scale) saturated to ±448.

Rounding is done in float32 bit arithmetic (`_round_to_e4m3`) and the cast to e4m3 is then exact.
Why: the Triton interpreter's float32 -> float8e4nv cast (triton 3.9, runtime/interpreter.py
_convert_float) rounds ties away from zero, loses the mantissa carry into the exponent
(127.99 -> 64) and does not saturate (500 -> 256); exact values convert correctly. On the GPU the
hardware cast of an exact value is exact too, so both paths produce the same bytes.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _round_to_e4m3(y):
    """y float32, |y| <= 448 -> the nearest e4m3 value (ties to even), as float32."""
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    # Normal e4m3 keeps 3 of float32's 23 mantissa bits: round the low 20 bits to nearest even.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    # Below 2^-6 e4m3 is subnormal, multiples of 2^-9: the 1.5 * 2^23 trick rounds to even.
    sub = ((a * 512.0 + 12582912.0) - 12582912.0) / 512.0
    mag = tl.where(a < 0.015625, sub, normal)
    return tl.where(y < 0, -mag, mag)


@triton.jit
def _round_to_bf16(x):
    """float32 -> the nearest bfloat16 value (ties to even), as float32 (x finite, >= 0)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_store(src, dst, dst_scale, mask, group_mask, SCALE_BF16: tl.constexpr):
    """src/dst: [BLOCK_NG, BLOCK_G] pointers; dst_scale: [BLOCK_NG] pointers."""
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    # div_rn: divisions rounded as IEEE (and torch) round them; a GPU's `/` is approximate (off by an ulp)
    scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 448.0)  # [BLOCK_NG]
    if SCALE_BF16:
        scale = _round_to_bf16(scale)
    safe = tl.where(scale > 0, scale, 1.0)
    y = tl.where(scale[:, None] > 0, tl.math.div_rn(x, safe[:, None]), 0.0)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    tl.store(dst, _round_to_e4m3(y).to(tl.float8e4nv), mask=mask)
    tl.store(dst_scale, scale.to(dst_scale.dtype.element_ty), mask=group_mask)


@triton.jit
def _store_kv_fp8_kernel(
    k_ptr,
    v_ptr,
    slot_ptr,
    blocks_ptr,
    scales_ptr,
    stride_k_l,
    stride_k_t,
    stride_k_h,
    stride_v_l,
    stride_v_t,
    stride_v_h,
    stride_b_page,
    stride_b_kv,
    stride_b_layer,
    stride_b_tok,
    stride_b_head,
    stride_s_page,
    stride_s_kv,
    stride_s_layer,
    stride_s_tok,
    stride_s_head,
    first_layer,
    num_pages,
    PAGE_SIZE: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_NG: tl.constexpr,
    BLOCK_G: tl.constexpr,
    SCALE_BF16: tl.constexpr,
):
    t, layer, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    page, offset = slot // PAGE_SIZE, slot % PAGE_SIZE
    valid = (slot >= 0) & (page < num_pages)  # never write the null page
    # A scalar bound, not `mask & valid`: the interpreter rejects a block mask and-ed with a scalar bool.
    num_groups = tl.where(valid, NUM_GROUPS, 0)
    grp = tl.arange(0, BLOCK_NG)
    ch = tl.arange(0, BLOCK_G)
    group_mask = grp < num_groups
    mask = group_mask[:, None] & (ch < GROUP)[None, :]
    d = grp[:, None] * GROUP + ch[None, :]  # [BLOCK_NG, BLOCK_G] channel index
    dst_layer = (first_layer + layer).to(tl.int64)
    dst = page * stride_b_page + dst_layer * stride_b_layer + offset * stride_b_tok + h * stride_b_head
    dst_s = page * stride_s_page + dst_layer * stride_s_layer + offset * stride_s_tok + h * stride_s_head
    k_src = k_ptr + layer * stride_k_l + t * stride_k_t + h * stride_k_h + d
    v_src = v_ptr + layer * stride_v_l + t * stride_v_t + h * stride_v_h + d
    _quantize_store(k_src, blocks_ptr + dst + d, scales_ptr + dst_s + grp, mask, group_mask, SCALE_BF16)
    _quantize_store(
        v_src, blocks_ptr + stride_b_kv + dst + d, scales_ptr + stride_s_kv + dst_s + grp, mask, group_mask, SCALE_BF16
    )


def store_kv_fp8(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    layer: int | None = None,
) -> None:
    """Quantize and write K/V: k, v [T, H, D] into `layer`, or [L, T, H, D] into every layer.

    blocks: float8_e4m3fn [N+1, 2, L, P, H, D]; scales: float32|bfloat16 [N+1, 2, L, P, H, D // g];
    slots: int [T]. Negative slots and slots on the null page are skipped.
    """
    assert blocks.dtype == torch.float8_e4m3fn and blocks.dim() == 6 and blocks.shape[1] == 2
    assert scales.dtype in (torch.float32, torch.bfloat16), scales.dtype
    assert scales.shape[:5] == blocks.shape[:5] and blocks.shape[-1] % scales.shape[-1] == 0
    assert blocks.stride(-1) == 1 and scales.stride(-1) == 1
    if layer is not None:
        k, v = k.unsqueeze(0), v.unsqueeze(0)
    num_layers, num_tokens, num_heads, head_dim = k.shape
    assert v.shape == k.shape and num_heads == blocks.shape[4] and head_dim == blocks.shape[5], (k.shape, blocks.shape)
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and slots.shape == (num_tokens,)
    assert (layer is None and num_layers == blocks.shape[2]) or (layer is not None and 0 <= layer < blocks.shape[2])
    if num_tokens == 0:
        return
    num_groups = scales.shape[-1]
    group = head_dim // num_groups
    _store_kv_fp8_kernel[(num_tokens, num_layers, num_heads)](
        k,
        v,
        slots,
        blocks,
        scales,
        *k.stride()[:3],
        *v.stride()[:3],
        *blocks.stride()[:5],
        *scales.stride()[:5],
        layer or 0,
        blocks.shape[0] - 1,
        PAGE_SIZE=blocks.shape[3],
        NUM_GROUPS=num_groups,
        GROUP=group,
        BLOCK_NG=triton.next_power_of_2(num_groups),
        BLOCK_G=triton.next_power_of_2(group),
        SCALE_BF16=scales.dtype == torch.bfloat16,
    )
