"""FP8 paged attention (decode and prefill): the Triton kernel against the torch reference, and
the FP8 result against float32 attention on the same random data."""

import pytest
import torch

from kernels.attention_fp8 import paged_attention_fp8
from kernels.decode import Launch, decode_launch
from kernels.reference import paged_attention_ref, store_kv_ref
from kernels.reference_fp8 import paged_attention_fp8_ref, store_kv_fp8_ref
from tests.kernels.paged_data import DEVICE, on_device

# Measured on random normal K/V and 2 × normal q (head_dim 64, 4 sequences of 5..100 tokens,
# g = 64 and 16, 5 seeds): ||out_fp8 - out_fp32|| / ||out_fp32|| = 0.032 .. 0.047.
FP8_REL_ERROR_BOUND = 0.08


def make_pool(
    lens: list[int], head_dim: int, group: int, num_pages: int, page_size: int, seed: int, layers: int = 2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V of `lens` tokens on randomly permuted pages, stored as FP8 and as float32."""
    torch.manual_seed(seed)
    heads = 2
    blocks = torch.zeros(num_pages + 1, 2, layers, page_size, heads, head_dim, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(num_pages + 1, 2, layers, page_size, heads, head_dim // group)
    blocks32 = torch.zeros(num_pages + 1, 2, layers, page_size, heads, head_dim)
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
    k, v = torch.randn(layers, len(slots), heads, head_dim), torch.randn(layers, len(slots), heads, head_dim)
    store_kv_fp8_ref(blocks, scales, k, v, slots)
    store_kv_ref(blocks32, k, v, slots)
    return blocks, scales, blocks32, lut


def batch(lens: list[int], q_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    cache_lengths = torch.tensor(lens) - torch.tensor(q_lens)
    return cache_lengths, torch.tensor([0, *q_lens]).cumsum(0)


CASES = [
    ([7, 10, 3], [1, 1, 1], {}),  # decode
    ([7, 10, 3], [3, 10, 2], {}),  # prefill: a whole prompt, and chunks after a cached prefix
    ([7, 10, 3], [1, 4, 2], {"sliding_window": 3, "softcap": 2.0, "scale": 0.3}),
    ([7, 10, 3], [1, 1, 1], {"sliding_window": 3, "softcap": 2.0, "scale": 0.3}),  # decode, windowed
]


@pytest.mark.parametrize("group", [32, 8], ids=["folded-scales", "grouped-scales"])
@pytest.mark.parametrize(
    "lens,q_lens,kwargs", CASES, ids=["decode", "prefill", "window-softcap", "decode-window-softcap"]
)
def test_kernel_matches_reference(group: int, lens: list[int], q_lens: list[int], kwargs: dict[str, float]) -> None:
    blocks, scales, _, lut = make_pool(lens, 32, group, num_pages=12, page_size=4, seed=group + len(kwargs))
    cache_lengths, qsl = batch(lens, q_lens)
    q = torch.randn(sum(q_lens), 4, 32)
    out = torch.full(q.shape, float("nan"), device=DEVICE)
    paged_attention_fp8(
        *on_device(q, blocks, scales), 1, *on_device(lut, cache_lengths, qsl), out=out, block_n=16, **kwargs
    )  # type: ignore[arg-type]
    expected = paged_attention_fp8_ref(q, blocks, scales, 1, lut, cache_lengths, qsl, **kwargs)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-6, rtol=2e-5)
    assert blocks[12].view(torch.uint8).eq(0).all() and scales[12].eq(0).all()  # the null page


@pytest.mark.parametrize("group", [32, 8], ids=["folded-scales", "grouped-scales"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_on_fp8_pages_runs_the_split_kv_decode_kernel(group: int, dtype: torch.dtype, splits: int) -> None:
    """One query per sequence on FP8 pages goes to kernels.decode's kernel (split-KV where asked); the old
    kernel (decode_block_n=None) and the reference agree with it."""
    lens = [29, 10, 3, 17]
    blocks, scales, _, lut = make_pool(lens, 32, group, num_pages=24, page_size=4, seed=splits + group)
    cache_lengths, qsl = batch(lens, [1] * len(lens))
    q = torch.randn(len(lens), 4, 32).to(dtype)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    d_q, d_blocks, d_scales, d_lut, d_lengths, d_qsl = on_device(q, blocks, scales, lut, cache_lengths, qsl)
    decode_launch(d_q, d_blocks, d_scales, 1, d_lut, d_lengths, out, None, Launch(splits, block_n=16), softcap=5.0)
    expected = paged_attention_fp8_ref(q, blocks, scales, 1, lut, cache_lengths, qsl, softcap=5.0)
    tol = {"atol": 2e-6, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(out.cpu(), expected, **tol)
    tables = (d_lut, d_lengths, d_qsl)
    via_wrapper = paged_attention_fp8(d_q, d_blocks, d_scales, 1, *tables, max_q_len=1, softcap=5.0)
    old_kernel = paged_attention_fp8(d_q, d_blocks, d_scales, 1, *tables, max_q_len=1, decode_block_n=None, softcap=5.0)
    torch.testing.assert_close(via_wrapper, old_kernel, **tol)
    torch.testing.assert_close(via_wrapper.cpu(), expected, **tol)


def test_same_kernel_reads_a_float32_pool() -> None:
    _, _, blocks32, lut = make_pool([7, 10, 3], 32, 32, num_pages=12, page_size=4, seed=5)
    cache_lengths, qsl = batch([7, 10, 3], [2, 1, 3])
    q = torch.randn(6, 4, 32)
    out = torch.full(q.shape, float("nan"), device=DEVICE)
    paged_attention_fp8(*on_device(q, blocks32), None, 0, *on_device(lut, cache_lengths, qsl), out=out, block_n=16)
    expected = paged_attention_ref(q, blocks32, 0, lut, cache_lengths, qsl)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("group", [64, 16])
def test_fp8_attention_is_close_to_float32(group: int) -> None:
    lens, q_lens = [100, 37, 64, 5], [1, 37, 3, 1]
    blocks, scales, blocks32, lut = make_pool(lens, 64, group, num_pages=40, page_size=8, seed=11, layers=1)
    cache_lengths, qsl = batch(lens, q_lens)
    q = torch.randn(sum(q_lens), 8, 64) * 2
    out = torch.full(q.shape, float("nan"), device=DEVICE)
    paged_attention_fp8(*on_device(q, blocks, scales), 0, *on_device(lut, cache_lengths, qsl), out=out)
    exact = paged_attention_ref(q, blocks32, 0, lut, cache_lengths, qsl)
    assert isinstance(exact, torch.Tensor)
    rel = float((out.cpu() - exact).norm() / exact.norm())
    assert 0.005 < rel < FP8_REL_ERROR_BOUND, rel  # FP8 does lose precision: the kernel did not read float32


@pytest.mark.gpu
@pytest.mark.parametrize("group", [128, 32])
def test_gpu_bf16_queries_realistic_shape(group: int) -> None:
    lens = [1000, 17, 513, 4096]
    blocks, scales, _, lut = make_pool(lens, 128, group, num_pages=400, page_size=16, seed=3)
    dev = torch.device("cuda")
    for q_lens in ([1, 1, 1, 1], [100, 17, 1, 300]):
        cache_lengths, qsl = batch(lens, q_lens)
        q = torch.randn(sum(q_lens), 16, 128, dtype=torch.bfloat16)
        args = [t.to(dev) for t in (blocks, scales)]
        tables = [t.to(dev) for t in (lut, cache_lengths, qsl)]
        out = paged_attention_fp8(q.to(dev), *args, 1, *tables)
        expected = paged_attention_fp8_ref(q.float(), blocks, scales, 1, lut, cache_lengths, qsl)
        torch.testing.assert_close(out.float().cpu(), expected, atol=2e-2, rtol=2e-2)


def test_bench_without_cuda_says_so_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.kernels import bench_fp8

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the gpu-marked test runs the benchmark")
    assert bench_fp8.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


@pytest.mark.gpu
def test_bench_quick_runs_on_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.kernels import bench_fp8

    assert bench_fp8.main(["--quick"]) == 0
    assert "fp8 speed-up over bf16" in capsys.readouterr().out
