"""Issue 26's figures, each against a ceiling measured in the same run, and its targets.

Decode at B = 64 x 4k (GQA 32/8, D 128, bf16, pages 16 and 128) against a device-to-device copy; the
split-KV path at B = 1..8 x 32k; torch SDPA (flash) on K/V gathered into contiguous tensors (the gather
timed apart) and FlashInfer where it imports (it does not travel: docs/KERNELS.md); prefill 8 x 2,048
causal against SDPA flash; FP8 decode tokens/s against the bf16 decode. The timing, the pools and the
peers are benchmarks/kernels/bench.py's (do_bench medians; it flushes L2 before every timed run).
The dry run calls everything once on tiny shapes and times nothing: its figures are null.
"""

import math
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.gpu.cases import fp8_scales, paged_batch
from benchmarks.gpu.report import Report
from benchmarks.kernels import bench

DECODE_PAGES = (16, 128)


def untimed(fn: Callable[[], Any]) -> float:
    """The dry run's timer: runs fn once, measures nothing."""
    fn()
    return math.nan


def num(value: Any) -> float | None:
    return float(value) if isinstance(value, float) and math.isfinite(value) else None


def run(report: Report, device: torch.device) -> None:
    dry = report.dry_run
    timer = untimed if dry else bench.median_ms
    decode_shape, split_ctx, prefill_shape = ((2, 40), 80, (2, 24)) if dry else ((64, 4096), 32768, (8, 2048))
    copy = bench.copy_bandwidth(device, timer, numel=2**12 if dry else 2**28)
    report.figure("figures", "device-to-device copy", copy, "GB/s (read + write)")
    bf16_us: dict[int, float | None] = {}
    for page in DECODE_PAGES:
        r = bench.decode_row(*decode_shape, page, copy, device, timer)
        name = f"decode B={decode_shape[0]} ctx={decode_shape[1]} page={page}"
        bf16_us[page] = report.figure("figures", name, num(r["us"]), "us", GBps=num(r["GB/s"]))
        report.figure("figures", f"{name} gather for SDPA", num(r["gather_us"]), "us")
        report.figure("figures", f"{name} SDPA flash on gathered K/V", num(r["sdpa_us"]), "us", note=r["sdpa_note"])
        fi = r["flashinfer_us"]
        report.figure("figures", f"{name} FlashInfer", num(fi), "us", note="" if num(fi) else str(fi))
        report.target(f"{name}: % of copy bandwidth", num(r["pct_copy"]), ">=", 80, "%")
        peers = [v for v in (num(r["sdpa_us"]), num(fi)) if v is not None]
        ratio = min(peers) / r["us"] if peers and num(r["us"]) else None
        report.target(
            f"{name}: fastest peer's time / ours (SDPA without its gather, FlashInfer)", ratio, ">=", 1.0, "x"
        )
    for batch in (1, 2) if dry else (1, 2, 4, 8):
        r = bench.decode_row(batch, split_ctx, DECODE_PAGES[0], copy, device, timer)
        name = f"split-KV decode B={batch} ctx={split_ctx} page={DECODE_PAGES[0]}"
        report.figure("figures", name, num(r["us"]), "us", GBps=num(r["GB/s"]))
        report.target(f"{name}: % of copy bandwidth", num(r["pct_copy"]), ">=", 60, "%")
    for page in DECODE_PAGES:
        r = bench.prefill_row(prefill_shape[0], 0, prefill_shape[1], page, device, timer)
        name = f"prefill {prefill_shape[0]}x{prefill_shape[1]} causal page={page}"
        ours, sdpa = num(r["TFLOP/s"]), num(r["sdpa_TFLOP/s"])
        report.figure("figures", name, ours, "TFLOP/s")
        report.figure("figures", f"{name} SDPA flash (contiguous)", sdpa, "TFLOP/s", note=r.get("sdpa_note", ""))
        report.target(f"{name}: ours / SDPA flash", ours / sdpa if ours and sdpa else None, ">=", 0.5, "x")
    fp8_us = fp8_decode_us(*decode_shape, DECODE_PAGES[0], device, timer)
    batch = decode_shape[0]
    report.figure("figures", f"FP8 decode B={batch} ctx={decode_shape[1]} page={DECODE_PAGES[0]}", fp8_us, "us")
    bf16 = bf16_us[DECODE_PAGES[0]]
    for label, us in (("FP8", fp8_us), ("bf16", bf16)):
        report.figure("figures", f"{label} decode tokens/s (one layer)", batch / us * 1e6 if us else None, "tokens/s")
    report.target("FP8 decode tokens/s / bf16 decode's", bf16 / fp8_us if bf16 and fp8_us else None, ">=", 1.6, "x")


def fp8_decode_us(batch: int, ctx: int, page: int, device: torch.device, timer: bench.Timer) -> float | None:
    """The FP8 kernel at the decode shape (32/8 heads, D 128, scales per 128 channels, bf16 queries)."""
    from benchmarks.kernels.peers import HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS
    from kernels.attention_fp8 import paged_attention_fp8

    b = paged_batch([ctx] * batch, page, NUM_KV_HEADS, HEAD_DIM, torch.float8_e4m3fn, device, seed=1)
    scales = fp8_scales(b.blocks, 128, torch.float32, seed=2)
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    cache = torch.full((batch,), ctx - 1, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    ms = timer(lambda: paged_attention_fp8(q, b.blocks, scales, 0, b.lookup_table, cache, qsl, max_q_len=1, out=out))
    return num(ms * 1e3)
