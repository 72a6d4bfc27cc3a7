"""Inputs and peers for `python -m benchmarks.kernels.bench`: paged pools on permuted pages, torch SDPA on the
same K/V gathered into contiguous tensors, FlashInfer's paged decode (when it imports)."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from service.core.layout import lut_columns, pages_for, sentinel

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16


@dataclass
class PagedCase:
    blocks: torch.Tensor  # [N + 1, 2, 1, P, Hkv, D]: one layer, so a page's K and V are contiguous
    lookup_table: torch.Tensor  # uint32 [B, cols], randomly permuted pages, sentinel-padded
    pages: torch.Tensor  # int64 [B, pages per sequence]
    lengths: list[int]  # tokens of K/V each sequence attends (prefix + new)


def make_case(batch: int, length: int, page_size: int, device: torch.device) -> PagedCase:
    """B sequences of `length` tokens each on randomly permuted pages of a pool with a few spare pages."""
    per_seq = pages_for(length, page_size)
    num_pages = batch * per_seq + 8
    blocks = torch.randn(num_pages + 1, 2, 1, page_size, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    blocks[num_pages] = 0
    pages = torch.randperm(num_pages, device=device)[: batch * per_seq].view(batch, per_seq)
    lut = torch.full((batch, lut_columns(per_seq)), sentinel(num_pages), dtype=torch.int64, device=device)
    lut[:, :per_seq] = pages
    return PagedCase(blocks, lut.to(torch.int32).view(torch.uint32), pages, [length] * batch)


def gather_contiguous(case: PagedCase) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V: [B, Hkv, length, D] contiguous, what a user without paging would hold."""
    length, page_size = case.lengths[0], case.blocks.shape[3]
    kv = case.blocks[case.pages, :, 0]  # [B, pages, 2, P, H, D]
    kv = kv.permute(2, 0, 4, 1, 3, 5).reshape(2, len(case.lengths), NUM_KV_HEADS, -1, HEAD_DIM)
    kv = kv[:, :, :, :length]
    assert kv.shape[3] == length and page_size
    return kv[0].contiguous(), kv[1].contiguous()


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """q: [B, Hq, Tq, D]; k, v: [B, Hkv, Tk, D]; the flash backend, with GQA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def sdpa_peer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[Callable[[], Any] | None, str]:
    """SDPA flash with enable_gqa; where this torch's flash backend lacks GQA, on K/V repeated per
    query head (same FLOPs, more bytes: the note says so)."""
    fn, why = try_peer(lambda: lambda: sdpa(q, k, v, causal))
    if fn is not None:
        return fn, ""
    group = q.shape[1] // k.shape[1]
    k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    fn, why_rep = try_peer(lambda: lambda: sdpa(q, k_rep, v_rep, causal))
    return fn, ("K/V heads repeated: " + why) if fn is not None else f"{why}; repeated: {why_rep}"


def try_peer(make: Callable[[], Callable[[], Any]]) -> tuple[Callable[[], Any] | None, str]:
    """(a runnable peer, "") or (None, why not): a peer that fails must not stop the benchmark."""
    try:
        fn = make()
        fn()
        torch.cuda.synchronize()
        return fn, ""
    except Exception as exc:  # the peers' errors vary by version; report and go on
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"


def flashinfer_decode(case: PagedCase, q: torch.Tensor) -> Callable[[], Any]:
    """FlashInfer's paged decode on the same pool and pages (CSR page table); plan() once, outside timing."""
    import flashinfer

    batch, per_seq = case.pages.shape
    page_size, device = case.blocks.shape[3], q.device
    length = case.lengths[0]
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * per_seq
    indices = case.pages.reshape(-1).to(torch.int32)
    last_page_len = torch.full((batch,), length - (per_seq - 1) * page_size, dtype=torch.int32, device=device)
    workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    wrapper.plan(
        indptr, indices, last_page_len, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, page_size,
        pos_encoding_mode="NONE", q_data_type=DTYPE, kv_data_type=DTYPE,
    )  # fmt: skip
    kv_cache = case.blocks[:, :, 0]  # [N + 1, 2, P, Hkv, D]: FlashInfer's single-tensor NHD layout
    assert kv_cache.is_contiguous()
    return lambda: wrapper.run(q, kv_cache)


def decode_bytes(batch: int, length: int) -> int:
    """K and V read once per KV head, plus Q read and O written."""
    kv = batch * length * NUM_KV_HEADS * HEAD_DIM * 2
    qo = 2 * batch * NUM_Q_HEADS * HEAD_DIM
    return (kv + qo) * DTYPE.itemsize


def prefill_flops(batch: int, prefix: int, new: int) -> int:
    """2 matmuls x 2 flops per visible (query, key) pair per head dim, causal within the new tokens."""
    pairs = new * prefix + new * (new + 1) // 2
    return 4 * HEAD_DIM * NUM_Q_HEADS * pairs * batch
