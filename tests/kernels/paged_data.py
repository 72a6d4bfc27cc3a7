"""Test data for the paged kernels: random pools, sequences scattered over permuted pages, and a
float64 dense attention computed from the sequences' own K/V (not from the pool)."""

import math
from dataclasses import dataclass

import torch

from service.core.layout import lut_columns, pages_for, sentinel

# The small tests run the kernels compiled on a GPU when there is one, else through Triton's
# interpreter on the CPU; data, references and float64 checks stay on the CPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


def random_pool(
    num_pages: int, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> torch.Tensor:
    """blocks [N + 1, 2, L, P, H, D] of random values (unused pages too, so a wrong page shows); null page 0."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randn(num_pages + 1, 2, num_layers, page_size, num_kv_heads, head_dim, generator=gen)
    blocks[num_pages] = 0
    return blocks.to(dtype)


@dataclass
class PagedSequences:
    lookup_table: torch.Tensor  # uint32 [B, cols], sentinel-padded, as the service builds it
    keys: list[torch.Tensor]  # float64 [n_i, Hkv, D]: exactly the values stored in the pool
    values: list[torch.Tensor]


def place_sequences(blocks: torch.Tensor, layer: int, lengths: list[int], seed: int) -> PagedSequences:
    """Give each sequence pages_for(n_i) randomly permuted pages and write random K/V at `layer`."""
    num_pages, page_size = blocks.shape[0] - 1, blocks.shape[3]
    gen = torch.Generator().manual_seed(seed)
    need = [pages_for(n, page_size) for n in lengths]
    assert sum(need) <= num_pages, "pool too small for the test"
    perm = torch.randperm(num_pages, generator=gen)
    cols = lut_columns(max(need, default=0))
    lut = torch.full((len(lengths), cols), sentinel(num_pages), dtype=torch.int64)
    keys, values, used = [], [], 0
    for i, n in enumerate(lengths):
        pages = perm[used : used + need[i]]
        used += need[i]
        lut[i, : need[i]] = pages
        k = torch.randn(n, *blocks.shape[4:], generator=gen).to(blocks.dtype)
        v = torch.randn(n, *blocks.shape[4:], generator=gen).to(blocks.dtype)
        pos = torch.arange(n)
        blocks[pages[pos // page_size], 0, layer, pos % page_size] = k
        blocks[pages[pos // page_size], 1, layer, pos % page_size] = v
        keys.append(k.double())
        values.append(v.double())
    return PagedSequences(lut.to(torch.uint32), keys, values)


def dense_attention(
    q: torch.Tensor,
    positions: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64. q: [Tq, Hq, D] at `positions` [Tq]; k, v: [n, Hkv, D] -> out [Tq, Hq, D], lse [Tq, Hq]."""
    group = q.shape[1] // k.shape[1]
    scale = 1 / math.sqrt(q.shape[2]) if scale is None else scale
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    q_pos, k_pos = positions[:, None], torch.arange(k.shape[0])[None, :]
    visible = k_pos <= q_pos
    if sliding_window:
        visible &= k_pos > q_pos - sliding_window
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)  # [Hq, Tq]
    out = torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), v)
    return out, lse.T


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """float32 data: elementwise 1e-4; 16-bit data (bf16/fp16 operands): relative norm error < 1e-2."""
    assert not torch.isnan(got).any(), f"{what}: NaN left (an element was not written)"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got, want = got.double(), want.double()
    if got.numel() == 0:
        return
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{what}: {m}")
    else:
        err = ((got - want).norm() / want.norm()).item()
        assert err < 1e-2, f"{what}: relative error {err:.2e}"
