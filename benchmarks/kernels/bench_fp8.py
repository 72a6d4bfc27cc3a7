"""`python -m benchmarks.kernels.bench_fp8`: FP8 decode vs bf16 decode on the same shapes, and FlashInfer /
flash_attn run directly on kvpool-layout pages through the exported tables (when they import).

Pages are randomly permuted; triton.testing.do_bench flushes L2 between runs. Bandwidth counts
K/V bytes once per KV head (+ FP8 scales) and is set against a device-to-device copy measured in
the same run (bytes read + written). Without CUDA it says so and exits 0.
"""

import argparse
import sys
from collections.abc import Callable

import numpy as np
import torch

from service.core.lut_formats import flash_attn_tables, flashinfer_tables


def make_pages(batch: int, context: int, page_size: int, seed: int = 0) -> tuple[torch.Tensor, int]:
    """LUT int32 [batch, pages + 16] over randomly permuted pages, and the pool's page count."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // page_size)
    num_pages = batch * per_seq
    lut = torch.full((batch, per_seq + 16), num_pages, dtype=torch.int32)
    lut[:, :per_seq] = torch.randperm(num_pages, generator=gen).view(batch, per_seq).to(torch.int32)
    return lut, num_pages


def timed(fn: Callable[[], object]) -> float:
    """Median milliseconds."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def copy_bandwidth(dev: torch.device) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def run_case(batch: int, context: int, hkv: int, hq: int, head_dim: int, page_size: int, copy_gbs: float) -> None:
    from kernels.attention_fp8 import paged_attention_fp8
    from kernels.store_fp8 import store_kv_fp8

    dev = torch.device("cuda")
    lut, num_pages = make_pages(batch, context, page_size)
    shape = (num_pages + 1, 2, 1, page_size, hkv, head_dim)
    bf16 = torch.zeros(shape, dtype=torch.bfloat16, device=dev)
    fp8 = torch.zeros(shape, dtype=torch.float8_e4m3fn, device=dev)
    scales = torch.zeros((*shape[:5], head_dim // 128 if head_dim % 128 == 0 else 1), device=dev)
    slots = (lut[:, : -(-context // page_size)].long()[:, :, None] * page_size + torch.arange(page_size)).flatten()
    slots = slots.view(batch, -1)[:, :context].flatten().to(dev)
    for chunk in slots.split(1 << 20):
        k = torch.randn(chunk.numel(), hkv, head_dim, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        bf16[chunk // page_size, 0, 0, chunk % page_size] = k
        bf16[chunk // page_size, 1, 0, chunk % page_size] = v
        store_kv_fp8(fp8, scales, k, v, chunk, layer=0)
    q = torch.randn(batch, hq, head_dim, device=dev, dtype=torch.bfloat16)
    lut_d = lut.to(dev)
    cache_lengths = torch.full((batch,), context - 1, dtype=torch.int32, device=dev)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    tokens = batch * context
    kv_bytes_bf16 = tokens * hkv * head_dim * 2 * 2
    kv_bytes_fp8 = tokens * hkv * head_dim * 2 + tokens * hkv * scales.shape[-1] * 2 * 4

    def kvpool(pool: torch.Tensor, sc: torch.Tensor | None) -> Callable[[], object]:
        return lambda: paged_attention_fp8(q, pool, sc, 0, lut_d, cache_lengths, qsl, max_q_len=1)

    out_bf16 = kvpool(bf16, None)()
    assert isinstance(out_bf16, torch.Tensor)
    ms_bf16, ms_fp8 = timed(kvpool(bf16, None)), timed(kvpool(fp8, scales))
    name = f"B={batch} ctx={context} Hkv={hkv} Hq={hq} D={head_dim} P={page_size}"
    for label, ms, nbytes in (("bf16", ms_bf16, kv_bytes_bf16), ("fp8", ms_fp8, kv_bytes_fp8)):
        gbs = nbytes / ms / 1e6
        print(f"{name}  kvpool {label:5s} {ms * 1e3:9.1f} us  {gbs:7.0f} GB/s  ({gbs / copy_gbs:5.1%} of copy)")
    print(f"{name}  fp8 speed-up over bf16: {ms_bf16 / ms_fp8:.2f}x (target >= 1.6x)")

    lengths = np.full(batch, context)
    peers: list[tuple[str, Callable[[], object]]] = []
    try:
        import flashinfer

        indptr, indices, last = (
            torch.from_numpy(t).to(dev) for t in flashinfer_tables(lut.numpy(), lengths, page_size)
        )
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(128 << 20, dtype=torch.uint8, device=dev), "NHD", use_tensor_cores=True
        )
        wrapper.plan(indptr, indices, last, hq, hkv, head_dim, page_size, q_data_type=torch.bfloat16)
        kv_view = (bf16[:, 0, 0], bf16[:, 1, 0])  # [N+1, P, Hkv, D] views of kvpool's pool
        peers.append(("flashinfer", lambda: wrapper.run(q, kv_view)))
    except Exception as exc:  # a missing or incompatible library is a line in the report, not a crash
        print(f"{name}  flashinfer: not run ({type(exc).__name__}: {str(exc)[:120]})")
    try:
        try:
            from flash_attn_interface import flash_attn_with_kvcache  # FlashAttention-3
        except ImportError:
            from flash_attn import flash_attn_with_kvcache

        block_table, seqlens = (torch.from_numpy(t).to(dev) for t in flash_attn_tables(lut.numpy(), lengths, page_size))
        k_cache, v_cache = bf16[:, 0, 0], bf16[:, 1, 0]
        peers.append(
            (
                "flash_attn",
                lambda: flash_attn_with_kvcache(
                    q[:, None], k_cache, v_cache, cache_seqlens=seqlens, block_table=block_table, causal=True
                ),
            )
        )
    except Exception as exc:
        print(f"{name}  flash_attn: not run ({type(exc).__name__}: {str(exc)[:120]})")
    for label, fn in peers:
        try:
            result = fn()
            out = result[0] if isinstance(result, tuple) else result
            assert isinstance(out, torch.Tensor)
            diff = (out.reshape(out_bf16.shape).float() - out_bf16.float()).abs().max().item()
            ms = timed(fn)
            gbs = kv_bytes_bf16 / ms / 1e6
            print(f"{name}  {label:16s} {ms * 1e3:9.1f} us  {gbs:7.0f} GB/s  max |diff| vs kvpool bf16 {diff:.3g}")
        except Exception as exc:
            print(f"{name}  {label}: failed on kvpool pages ({type(exc).__name__}: {str(exc)[:160]})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="one small case")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.kernels.bench_fp8: no CUDA device here, nothing to time (run it on a GPU machine).")
        return 0
    copy_gbs = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_gbs:.0f} GB/s (read + write)")
    cases = (
        [(16, 1024, 8, 32, 128, 16)]
        if args.quick
        else [
            (64, 4096, 8, 32, 128, 16),
            (128, 2048, 8, 64, 128, 16),
            (32, 8192, 8, 32, 128, 64),
            (64, 4096, 8, 32, 128, 256),  # FlashAttention-2's paged path needs page_size % 256 == 0
        ]
    )
    for case in cases:
        run_case(*case, copy_gbs=copy_gbs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
