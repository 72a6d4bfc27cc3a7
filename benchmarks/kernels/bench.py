"""`python -m benchmarks.kernels.bench`: paged decode and prefill on realistic shapes against the copy bandwidth,
torch SDPA (flash) on contiguous K/V and FlashInfer's paged decode.

32 query / 8 KV heads, head_dim 128, bf16, pages 16 and 128 randomly permuted. Times are medians of
triton.testing.do_bench, which writes a 256 MB buffer before every timed run to flush L2 (50-60 MB on
H100/H200). GB/s = 1e9 bytes/s; bytes = K/V once per KV head + Q + O.
"""

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

# (batch, context) and (batch, cached prefix, new tokens); K/V bytes stay <= 4 GiB per case.
DECODE_SHAPES = [(1, 512), (1, 32768), (8, 8192), (16, 32768), (64, 4096), (64, 16384), (128, 2048), (256, 512)]
DECODE_SHAPES += [(256, 4096)]
PREFILL_SHAPES = [(1, 0, 4096), (4, 0, 2048), (8, 0, 1024), (1, 0, 16384), (4, 4096, 512), (1, 16384, 2048)]
QUICK_DECODE, QUICK_PREFILL = [(1, 32768), (64, 4096)], [(4, 0, 2048), (4, 4096, 512)]
PAGE_SIZES = [16, 128]


Timer = Callable[[Callable[[], Any]], float]


def median_ms(fn: Any) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def copy_bandwidth(device: torch.device, timer: Timer = median_ms, numel: int = 2**28) -> float:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read + written."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * src.nbytes / ms / 1e6


def decode_row(
    batch: int, ctx: int, page_size: int, copy_gbs: float, dev: torch.device | None = None, timer: Timer = median_ms
) -> dict[str, Any]:
    """One decode shape: ours, the gather + SDPA a user without paging would run, FlashInfer."""
    from benchmarks.kernels.peers import (
        DTYPE,
        HEAD_DIM,
        NUM_Q_HEADS,
        decode_bytes,
        flashinfer_decode,
        gather_contiguous,
        make_case,
        sdpa_peer,
        try_peer,
    )
    from kernels.decode import paged_decode

    dev = dev or torch.device("cuda")
    case = make_case(batch, ctx, page_size, dev)
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=dev)
    cache_lengths = torch.full((batch,), ctx - 1, dtype=torch.int32, device=dev)  # the query is token ctx
    out = torch.empty_like(q)
    ms = timer(lambda: paged_decode(q, case.blocks, 0, case.lookup_table, cache_lengths, out=out))
    gbs = decode_bytes(batch, ctx) / ms / 1e6
    row: dict[str, Any] = {"kernel": "decode", "page": page_size, "batch": batch, "ctx": ctx, "us": ms * 1e3}
    row |= {"GB/s": gbs, "pct_copy": 100 * gbs / copy_gbs}
    k, v = gather_contiguous(case)
    row["gather_us"] = timer(lambda: gather_contiguous(case)) * 1e3
    q4 = q[:, :, None, :]  # [B, Hq, 1, D]
    fn, note = sdpa_peer(q4, k, v, causal=False)
    row["sdpa_us"] = timer(fn) * 1e3 if fn else note
    row["sdpa_note"] = note
    fn, why = try_peer(lambda: flashinfer_decode(case, q))
    row["flashinfer_us"] = timer(fn) * 1e3 if fn else why
    return row


def _x(peer: Any, ours: float) -> str:
    """How many times longer the peer takes (> 1: ours is faster)."""
    return f"{peer / ours:8.2f}" if isinstance(peer, float) else f"{'n/a':>8}"


def _us(value: Any) -> str:
    return f"{value:9.1f}" if isinstance(value, float) else f"{'n/a':>9}"


def bench_decode(shapes: list[tuple[int, int]], copy_gbs: float, rows: list[dict[str, Any]]) -> None:
    print(f"\n{'decode':<8}{'page':>5}{'batch':>6}{'ctx':>7}{'us':>9}{'GB/s':>8}{'%copy':>7}"
          f"{'sdpa us':>9}{'gather':>9}{'x sdpa':>8}{'fi us':>9}{'x fi':>8}")  # fmt: skip
    for page_size in PAGE_SIZES:
        for batch, ctx in shapes:
            r = decode_row(batch, ctx, page_size, copy_gbs)
            rows.append(r)
            print(f"{'':<8}{page_size:>5}{batch:>6}{ctx:>7}{r['us']:>9.1f}{r['GB/s']:>8.0f}{r['pct_copy']:>7.1f}"
                  f"{_us(r['sdpa_us'])}{r['gather_us']:>9.1f}{_x(r['sdpa_us'], r['us'])}"
                  f"{_us(r['flashinfer_us'])}{_x(r['flashinfer_us'], r['us'])}", flush=True)  # fmt: skip
            for peer in ("sdpa_us", "flashinfer_us"):
                if not isinstance(r[peer], float):
                    print(f"{'':<8}  {peer[:-3]}: {r[peer]}")
            if r.get("sdpa_note") and isinstance(r["sdpa_us"], float):
                print(f"{'':<8}  sdpa: {r['sdpa_note']}")


def prefill_row(
    batch: int, prefix: int, new: int, page_size: int, dev: torch.device | None = None, timer: Timer = median_ms
) -> dict[str, Any]:
    """One prefill shape: ours and, without a prefix (where SDPA's causal mask means the same), SDPA."""
    from benchmarks.kernels.peers import (
        DTYPE,
        HEAD_DIM,
        NUM_Q_HEADS,
        gather_contiguous,
        make_case,
        prefill_flops,
        sdpa_peer,
    )
    from kernels.prefill import paged_prefill

    dev = dev or torch.device("cuda")
    case = make_case(batch, prefix + new, page_size, dev)
    q = torch.randn(batch * new, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=dev)
    cache_lengths = torch.full((batch,), prefix, dtype=torch.int32, device=dev)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev) * new
    out = torch.empty_like(q)
    ms = timer(lambda: paged_prefill(q, case.blocks, 0, case.lookup_table, cache_lengths, qsl, out=out))
    flops = prefill_flops(batch, prefix, new)
    row: dict[str, Any] = {"kernel": "prefill", "page": page_size, "batch": batch, "prefix": prefix, "new": new}
    row |= {"ms": ms, "TFLOP/s": flops / ms / 1e9, "sdpa_TFLOP/s": "n/a: SDPA's causal mask is top-left aligned"}
    if prefix == 0:
        k, v = gather_contiguous(case)
        q4 = q.view(batch, new, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2)  # [B, Hq, new, D]
        fn, note = sdpa_peer(q4, k, v, causal=True)
        row["sdpa_TFLOP/s"] = flops / timer(fn) / 1e9 if fn else note
        row["sdpa_note"] = note
    return row


def bench_prefill(shapes: list[tuple[int, int, int]], rows: list[dict[str, Any]]) -> None:
    print(f"\n{'prefill':<8}{'page':>5}{'batch':>6}{'prefix':>7}{'new':>6}{'ms':>9}{'TFLOP/s':>9}{'sdpa':>9}{'x':>8}")
    for page_size in PAGE_SIZES:
        for batch, prefix, new in shapes:
            r = prefill_row(batch, prefix, new, page_size)
            rows.append(r)
            sd = r["sdpa_TFLOP/s"]
            ratio = f"{r['TFLOP/s'] / sd:8.2f}" if isinstance(sd, float) else f"{'n/a':>8}"
            print(f"{'':<8}{page_size:>5}{batch:>6}{prefix:>7}{new:>6}{r['ms']:>9.3f}{r['TFLOP/s']:>9.1f}"
                  f"{_us(sd)}{ratio}", flush=True)  # fmt: skip
            if r.get("sdpa_note"):
                print(f"{'':<8}  sdpa: {r['sdpa_note']}")


def print_targets(rows: list[dict[str, Any]]) -> None:
    print("\ntargets (H100/H200):")
    for r in rows:
        if r["kernel"] == "decode" and (r["page"], r["batch"], r["ctx"]) == (16, 64, 4096):
            fi = r["flashinfer_us"]
            fi_ok = (
                "n/a (flashinfer not available)" if not isinstance(fi, float) else ("PASS" if r["us"] <= fi else "FAIL")
            )
            print(f"  decode b64 ctx4096 page16: {r['pct_copy']:.1f}% of copy bandwidth (>= 80%: "
                  f"{'PASS' if r['pct_copy'] >= 80 else 'FAIL'}); vs FlashInfer {fi_ok}")  # fmt: skip
    for r in rows:
        if r["kernel"] == "prefill" and isinstance(r["sdpa_TFLOP/s"], float):
            ratio = r["TFLOP/s"] / r["sdpa_TFLOP/s"]
            print(f"  prefill page{r['page']} b{r['batch']} new{r['new']}: {100 * ratio:.0f}% of SDPA TFLOP/s "
                  f"(>= 50%: {'PASS' if ratio >= 0.5 else 'FAIL'})")  # fmt: skip


def interpret_smoke() -> int:
    """Tiny decode + prefill through Triton's interpreter against the torch reference (no timing)."""
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules import triton.jit
    from kernels.decode import paged_decode
    from kernels.prefill import paged_prefill
    from kernels.reference import paged_attention_ref, paged_decode_ref

    blocks = torch.randn(13, 2, 1, 4, 2, 64)
    blocks[12] = 0
    lut = torch.randperm(12)[:10].view(2, 5).to(torch.int32)
    q, cache_lengths = torch.randn(2, 8, 64), torch.tensor([6, 19])
    got, want = paged_decode(q, blocks, 0, lut, cache_lengths), paged_decode_ref(q, blocks, 0, lut, cache_lengths)
    assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
    errors = [(got - want).abs().max().item()]
    print(f"interpret smoke: decode max |err| {errors[0]:.2e}")
    q, qsl = torch.randn(7, 8, 64), torch.tensor([0, 3, 7])
    got, want = (
        paged_prefill(q, blocks, 0, lut, cache_lengths - 3, qsl),
        paged_attention_ref(q, blocks, 0, lut, cache_lengths - 3, qsl),
    )
    assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
    errors.append((got - want).abs().max().item())
    print(f"interpret smoke: prefill max |err| {errors[1]:.2e}")
    return 0 if max(errors) < 1e-4 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the target shapes and one more each")
    parser.add_argument("--only", choices=["decode", "prefill"], help="run one kernel's sweep")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--interpret-smoke", action="store_true", help="without CUDA: a tiny interpreter run")
    parser.add_argument("--tune", action="store_true", help="sweep launch settings of the target shapes instead")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.kernels.bench: no CUDA device here, so nothing is timed (the figures need an H100/H200).")
        return interpret_smoke() if args.interpret_smoke else 0
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    copy_gbs = copy_bandwidth(dev)
    print(f"device: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; "
          f"torch {torch.__version__}; device-to-device copy {copy_gbs:.0f} GB/s (read + write)")  # fmt: skip
    if args.tune:
        from benchmarks.kernels.tune import tune

        tune(median_ms)
        return 0
    rows: list[dict[str, Any]] = []
    if args.only in (None, "decode"):
        bench_decode(QUICK_DECODE if args.quick else DECODE_SHAPES, copy_gbs, rows)
    if args.only in (None, "prefill"):
        bench_prefill(QUICK_PREFILL if args.quick else PREFILL_SHAPES, rows)
    print_targets(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": props.name, "copy_GB/s": copy_gbs, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
