"""MLA decode and prefill over latent pages: the reference against a dense computation written
out here, the Triton kernels (store, attention) against the reference."""

import math

import pytest
import torch

from kernels.mla import mla_attention, store_latent
from kernels.reference_mla import mla_attention_ref, store_latent_ref
from tests.kernels.paged_data import DEVICE, on_device

RANK, ROPE, N, P, L = 64, 16, 12, 4, 2
D = RANK + ROPE
LENS = [7, 10, 3]


def make_pool(
    seed: int, rank: int = RANK, rope: int = ROPE, lens: list[int] = LENS, num_pages: int = N, page_size: int = P
):
    """Latents of `lens` tokens on permuted pages: (blocks [N+1, 1, L, P, 1, D], lut, latents per sequence)."""
    torch.manual_seed(seed)
    dim = rank + rope
    blocks = torch.zeros(num_pages + 1, 1, L, page_size, 1, dim)
    lut = torch.full((len(lens), -(-max(lens) // page_size) + 16), num_pages, dtype=torch.int32)
    perm, used = torch.randperm(num_pages), 0
    for i, n in enumerate(lens):
        pages = -(-n // page_size)
        lut[i, :pages] = perm[used : used + pages]
        used += pages
    slots = torch.cat(
        [
            lut[i, torch.arange(n) // page_size].long() * page_size + torch.arange(n) % page_size
            for i, n in enumerate(lens)
        ]
    )
    latent = torch.randn(L, len(slots), 1, dim)
    store_latent_ref(blocks, latent, slots)
    per_seq = list(latent[:, :, 0].split(lens, dim=1))  # [L, n, D] each
    return blocks, lut, per_seq, slots, latent


def batch(q_lens: list[int], lens: list[int] = LENS) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(lens) - torch.tensor(q_lens), torch.tensor([0, *q_lens]).cumsum(0)


def dense_mla(q: torch.Tensor, latent: torch.Tensor, rank: int) -> torch.Tensor:
    """q: [Tq, Hq, D] at the last Tq positions of latent [Tk, D]; causal; float64."""
    tq, tk = q.shape[0], latent.shape[0]
    s = torch.einsum("qhd,kd->hqk", q.double(), latent.double()) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.arange(tk)[None, :] > torch.arange(tk - tq, tk)[:, None], float("-inf"))
    return torch.einsum("hqk,kr->qhr", s.softmax(-1), latent[:, :rank].double())


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [3, 10, 2]], ids=["decode", "prefill"])
def test_reference_matches_dense(q_lens: list[int]) -> None:
    blocks, lut, per_seq, _, _ = make_pool(1)
    cache_lengths, qsl = batch(q_lens)
    q = torch.randn(sum(q_lens), 8, D)
    out = mla_attention_ref(q, blocks, 1, lut, cache_lengths, qsl, RANK)
    assert out.shape == (sum(q_lens), 8, RANK)
    for i, chunk in enumerate(q.split(q_lens)):
        expected = dense_mla(chunk, per_seq[i][1], RANK)
        torch.testing.assert_close(out[int(qsl[i]) : int(qsl[i + 1])].double(), expected, atol=1e-5, rtol=1e-5)


def test_store_latent_matches_reference() -> None:
    _, _, _, slots, latent = make_pool(2)
    slots = torch.cat([slots, torch.tensor([N * P, -1])])  # the null page and a negative slot: skipped
    latent = torch.cat([latent, torch.randn(L, 2, 1, D)], dim=1)
    blocks = torch.zeros(N + 1, 1, L, P, 1, D, device=DEVICE)
    expected = torch.zeros(N + 1, 1, L, P, 1, D)
    store_latent(blocks, *on_device(latent, slots))
    store_latent_ref(expected, latent, slots)
    assert torch.equal(blocks.cpu(), expected)
    store_latent(blocks, *on_device(latent[0] * 3, slots), layer=1)
    store_latent_ref(expected, latent[0] * 3, slots, layer=1)
    assert torch.equal(blocks.cpu(), expected)
    assert blocks[N].eq(0).all()


@pytest.mark.parametrize(
    "q_lens,kwargs",
    [([1, 1, 1], {}), ([3, 10, 2], {}), ([1, 4, 2], {"sliding_window": 3, "softcap": 2.0, "scale": 0.2})],
    ids=["decode", "prefill", "window-softcap"],
)
@pytest.mark.parametrize("num_q_heads", [8, 20])
def test_kernel_matches_reference(q_lens: list[int], kwargs: dict[str, float], num_q_heads: int) -> None:
    blocks, lut, _, _, _ = make_pool(3)
    cache_lengths, qsl = batch(q_lens)
    q = torch.randn(sum(q_lens), num_q_heads, D)
    out = torch.full((sum(q_lens), num_q_heads, RANK), float("nan"), device=DEVICE)
    d_q, d_blocks, d_lut, d_lengths, d_qsl = on_device(q, blocks, lut, cache_lengths, qsl)
    mla_attention(d_q, d_blocks, 1, d_lut, d_lengths, d_qsl, RANK, out=out, block_n=16, **kwargs)  # type: ignore[arg-type]
    expected = mla_attention_ref(q, blocks, 1, lut, cache_lengths, qsl, RANK, **kwargs)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-6, rtol=2e-5)


@pytest.mark.gpu
def test_gpu_realistic_latent_576() -> None:
    lens = [1000, 17, 513, 2048]
    blocks, lut, _, _, _ = make_pool(4, rank=512, rope=64, lens=lens, num_pages=120, page_size=32)
    dev = torch.device("cuda")
    for q_lens in ([1, 1, 1, 1], [100, 17, 1, 64]):
        cache_lengths, qsl = batch(q_lens, lens)
        q = torch.randn(sum(q_lens), 16, 576, dtype=torch.bfloat16)
        out = mla_attention(
            q.to(dev), blocks.to(dev).bfloat16(), 0, lut.to(dev), cache_lengths.to(dev), qsl.to(dev), 512
        )
        expected = mla_attention_ref(q.float(), blocks.bfloat16().float(), 0, lut, cache_lengths, qsl, 512)
        torch.testing.assert_close(out.float().cpu(), expected, atol=2e-2, rtol=2e-2)
