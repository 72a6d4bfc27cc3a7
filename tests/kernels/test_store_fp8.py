"""FP8 quantize-and-store: the Triton kernel against the torch reference, byte for byte."""

import pytest
import torch

from kernels.reference_fp8 import dequantize_fp8, quantize_fp8, store_kv_fp8_ref
from kernels.store_fp8 import store_kv_fp8
from tests.kernels.paged_data import on_device

N, L, P, H = 6, 2, 4, 2


def store(blocks: torch.Tensor, scales: torch.Tensor, *args: torch.Tensor, **kwargs: int) -> None:
    """store_kv_fp8 on the test device (the GPU where there is one), into these CPU pools."""
    d_blocks, d_scales = on_device(blocks, scales)
    store_kv_fp8(d_blocks, d_scales, *on_device(*args), **kwargs)
    blocks.copy_(d_blocks.cpu())
    scales.copy_(d_scales.cpu())


def pools(head_dim: int, group: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = torch.zeros(N + 1, 2, L, P, H, head_dim, dtype=torch.float8_e4m3fn)
    return blocks, torch.zeros(N + 1, 2, L, P, H, head_dim // group, dtype=scale_dtype)


def test_quantize_exact_values() -> None:
    # One group of 4: amax 3.5 -> scale 3.5 / 448 = 2^-7 exactly; x / scale are e4m3 values.
    values, scales = quantize_fp8(torch.tensor([[0.5, -1.75, 3.5, 0.0], [0.0, 0.0, 0.0, 0.0]]), 4)
    assert scales.tolist() == [[2**-7], [0.0]]
    assert values.float().tolist() == [[64.0, -224.0, 448.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    assert dequantize_fp8(values, scales).tolist() == [[0.5, -1.75, 3.5, 0.0], [0.0, 0.0, 0.0, 0.0]]


# With amax 448 the scale is 1 and the kernel's rounding shows directly: ties go to even
# (2.625 -> 2.5, -336 -> -320), rounding up carries into the exponent (127.99 -> 128), and
# subnormals are multiples of 2^-9 (0.00293 -> 0.0029296875 = 3 * 2^-10 rounds to 2^-9 * 1.5 ->
# even 2 * 2^-9). The Triton interpreter's own float32 -> e4m3 cast gets the first three wrong.
ROUNDING = [
    (448.0, 448.0),
    (2.625, 2.5),
    (-336.0, -320.0),
    (127.99, 128.0),
    (0.0029296875, 0.00390625),
    (-0.3, -0.3125),
]


def test_store_rounds_to_nearest_even_like_torch() -> None:
    blocks, scales = pools(16, 16, torch.float32)
    k = torch.zeros(1, 16)
    k[0, : len(ROUNDING)] = torch.tensor([x for x, _ in ROUNDING])
    k = k.view(1, 1, 16).expand(1, H, 16).contiguous()
    store(blocks, scales, k, k.clone(), torch.tensor([5]), layer=0)
    stored = blocks[1, 0, 0, 1, 0, : len(ROUNDING)].float().tolist()
    assert stored == [y for _, y in ROUNDING]
    assert scales[1, 0, 0, 1, 0].tolist() == [1.0]


@pytest.mark.parametrize("head_dim,group", [(32, 32), (32, 8), (24, 8)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_store_matches_reference(head_dim: int, group: int, scale_dtype: torch.dtype) -> None:
    torch.manual_seed(head_dim + group)
    blocks, scales = pools(head_dim, group, scale_dtype)
    ref_blocks, ref_scales = blocks.clone(), scales.clone()
    # Per-token magnitudes spread over 1e-4 .. 10, one all-zero group, one tiny (subnormal) head.
    k = torch.randn(L, 7, H, head_dim) * torch.logspace(-4, 1, 7)[None, :, None, None]
    v = torch.randn(L, 7, H, head_dim)
    k[0, 0, 0, :group] = 0
    v[1, 2, 1] *= 1e-3
    slots = torch.tensor([0, 5, 6, 13, N * P + 1, -1, 22])  # one on the null page, one negative
    store(blocks, scales, k, v, slots)
    store_kv_fp8_ref(ref_blocks, ref_scales, k, v, slots)
    assert torch.equal(blocks.view(torch.uint8), ref_blocks.view(torch.uint8))
    assert torch.equal(scales, ref_scales)
    assert scales[0, 0, 0, 0, 0, 0] == 0 and blocks[0, 0, 0, 0, 0, :group].float().abs().sum() == 0

    # One layer into layer 1, over the same slots.
    store(blocks, scales, v[0], k[1], slots, layer=1)
    store_kv_fp8_ref(ref_blocks, ref_scales, v[0], k[1], slots, layer=1)
    assert torch.equal(blocks.view(torch.uint8), ref_blocks.view(torch.uint8))
    assert torch.equal(scales, ref_scales)

    # The null page and every slot never written keep zero values and zero scales.
    written = torch.zeros(N + 1, P, dtype=torch.bool)
    for slot in (0, 5, 6, 13, 22):
        written[slot // P, slot % P] = True
    assert not written[N].any()
    assert blocks.view(torch.uint8)[~written.view(N + 1, 1, 1, P).expand(-1, 2, L, -1)].eq(0).all()
    assert scales[~written.view(N + 1, 1, 1, P).expand(-1, 2, L, -1)].eq(0).all()

    # Dequantized values are within e4m3's rounding of the input: 2^-4 relative for normals,
    # half a subnormal step (scale * 2^-10) absolute.
    pages, offsets = torch.tensor([0, 1, 1, 3, 5]), torch.tensor([0, 1, 2, 1, 2])
    deq = dequantize_fp8(blocks[pages, 1, 1, offsets], scales[pages, 1, 1, offsets])  # k[1] went there
    x = k[1][[0, 1, 2, 3, 6]]
    scale = scales[pages, 1, 1, offsets].float().repeat_interleave(group, dim=-1)
    if scale_dtype == torch.bfloat16:  # x / rounded scale may saturate at 448: allow bf16's 2^-8 more
        scale = scale * (1 + 2**-7)
    assert ((deq - x).abs() <= torch.maximum(x.abs() * 2**-4 * (1 + 2**-7), scale * 2**-10 * 1.01)).all()


@pytest.mark.gpu
def test_gpu_store_matches_reference() -> None:
    """On the GPU x / scale may round differently in the last float32 bit, so an e4m3 value may
    land one step away in rare ties; scales are computed the same way and must match exactly."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    blocks = torch.zeros(65, 2, 2, 16, 8, 128, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(65, 2, 2, 16, 8, 1)
    k, v = torch.randn(2, 1000, 8, 128), torch.randn(2, 1000, 8, 128)
    slots = torch.randperm(64 * 16)[:1000]
    ref_blocks, ref_scales = blocks.clone(), scales.clone()
    store_kv_fp8_ref(ref_blocks, ref_scales, k, v, slots)
    gpu_blocks, gpu_scales = blocks.to(dev), scales.to(dev)
    store_kv_fp8(gpu_blocks, gpu_scales, k.to(dev), v.to(dev), slots.to(dev))
    assert torch.equal(gpu_scales.cpu(), ref_scales)
    same = gpu_blocks.cpu().view(torch.uint8) == ref_blocks.view(torch.uint8)
    assert same.float().mean() > 0.999
    torch.testing.assert_close(gpu_blocks.cpu().float(), ref_blocks.float(), atol=2**-9, rtol=2**-3)
    assert gpu_blocks[64].view(torch.uint8).eq(0).all()
