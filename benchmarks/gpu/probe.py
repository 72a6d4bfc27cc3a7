"""Figures that choose the next change for the targets the first GPU run missed (figures only, no
targets; each variant is timed once, so read them as leads):

- split-KV decode at B = 1, 2, 4, 8 x 32k (page 16): the default launch timed by do_bench (the
  wrapper's launches in the time, L2 flushed) and by CUDA-graph replay (the kernels alone, as an
  engine that captures its decode step runs them), then the split count, BLOCK_N, warps and stages;
- FP8 decode at B = 64 x 4k: kernels.decode's FP8 path over BLOCK_N and warps, the older FP8 kernel,
  and the bf16 decode, all timed by graph replay.

The part stops starting variants once its own share of the budget (PROBE_S) is spent.
"""

import math
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from benchmarks.gpu.report import Report
from benchmarks.kernels import bench

PART = "probe"
PROBE_S = 35.0


def graph_ms(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, rep=20, return_mode="median"))


class Probe:
    def __init__(self, report: Report, device: torch.device) -> None:
        self.report, self.device, self.began = report, device, time.monotonic()

    def timed(self, name: str, fn: Callable[[], Any], nbytes: int, how: str = "graph") -> None:
        if time.monotonic() - self.began > PROBE_S or self.report.left_s() < 60:
            return
        try:
            fn()  # compile outside the timing (and the graph capture)
            timer = bench.median_ms if how == "do_bench" else graph_ms
            us = math.nan if self.report.dry_run else timer(fn) * 1e3
            gbs = None if self.report.dry_run else nbytes / us / 1e3
            self.report.figure(PART, f"{name} [{how}]", us, "us", GBps=gbs)
        except Exception as exc:  # a variant that does not compile or capture is a finding, not a stop
            self.report.check(PART, f"{name} [{how}] ran", False, error=f"{type(exc).__name__}: {exc}"[:200])

    def split_kv(self, batch: int, ctx: int) -> None:
        from benchmarks.kernels.peers import HEAD_DIM, NUM_Q_HEADS, decode_bytes, make_case
        from kernels.decode import paged_decode

        case = make_case(batch, ctx, 16, self.device)
        q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, dtype=case.blocks.dtype, device=self.device)
        cache = torch.full((batch,), ctx - 1, dtype=torch.int32, device=self.device)
        out = torch.empty_like(q)
        nbytes = decode_bytes(batch, ctx)

        def decode(num_splits: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                   num_stages: int | None = None) -> None:  # fmt: skip
            paged_decode(q, case.blocks, 0, case.lookup_table, cache, out=out, num_splits=num_splits,
                         block_n=block_n, num_warps=num_warps, num_stages=num_stages)  # fmt: skip

        self.timed(f"split-KV B={batch} ctx={ctx} default", decode, nbytes, "do_bench")
        self.timed(f"split-KV B={batch} ctx={ctx} default", decode, nbytes)
        if batch not in (1, 4) or self.report.dry_run:
            return
        for splits in (16, 32):
            for block_n, warps, stages in ((64, 4, 2), (64, 8, 3), (128, 4, 3), (128, 8, 3), (128, 8, 4)):
                launch = {"num_splits": splits, "block_n": block_n, "num_warps": warps, "num_stages": stages}
                name = f"split-KV B={batch} ctx={ctx} splits={splits} N={block_n} warps={warps} stages={stages}"
                self.timed(name, partial(decode, **launch), nbytes)

    def fp8_decode(self, batch: int, ctx: int) -> None:
        from benchmarks.gpu.cases import fp8_scales, paged_batch
        from benchmarks.kernels.peers import HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS, decode_bytes, make_case
        from kernels.attention_fp8 import paged_attention_fp8
        from kernels.decode import paged_decode

        dev = self.device
        b = paged_batch([ctx] * batch, 16, NUM_KV_HEADS, HEAD_DIM, torch.float8_e4m3fn, dev, seed=1)
        scales = fp8_scales(b.blocks, HEAD_DIM, torch.float32, seed=2)
        q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        cache = torch.full((batch,), ctx - 1, dtype=torch.int32, device=dev)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        out = torch.empty_like(q)
        fp8_bytes = decode_bytes(batch, ctx) // 2  # a byte a value (the scales add 1/64 of that)

        def fp8(**launch: Any) -> None:
            paged_attention_fp8(q, b.blocks, scales, 0, b.lookup_table, cache, qsl, max_q_len=1, out=out, **launch)

        bf16 = make_case(batch, ctx, 16, dev)
        name = f"decode B={batch} ctx={ctx}"
        self.timed(f"bf16 {name}", lambda: paged_decode(q, bf16.blocks, 0, bf16.lookup_table, cache, out=out),
                   decode_bytes(batch, ctx))  # fmt: skip
        self.timed(f"FP8 {name} default", fp8, fp8_bytes)
        self.timed(f"FP8 {name} older kernel", partial(fp8, decode_block_n=None), fp8_bytes)
        if self.report.dry_run:
            return
        for block_n in (64, 128):
            for warps in (4, 8):
                self.timed(f"FP8 {name} N={block_n} warps={warps}", partial(fp8, decode_block_n=block_n,
                           num_warps=warps), fp8_bytes)  # fmt: skip
        # f16 dot operands (one conversion per pair of e4m3 values instead of four): the same output first.
        fp8()
        want = out.clone()
        out.fill_(float("nan"))
        fp8(fp8_as_f16=True)
        err = float((out.float() - want.float()).norm() / want.float().norm())
        self.report.check(PART, f"FP8 {name} with f16 dots = the default's", err < 1e-2, rel_err=err)
        for block_n in (64, 128):
            self.timed(f"FP8 {name} N={block_n} f16 dots", partial(fp8, decode_block_n=block_n, fp8_as_f16=True),
                       fp8_bytes)  # fmt: skip


def run(report: Report, device: torch.device) -> None:
    probe = Probe(report, device)
    for batch in (1, 2) if report.dry_run else (1, 2, 4, 8):
        probe.split_kv(batch, 80 if report.dry_run else 32768)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    probe.fp8_decode(*((2, 40) if report.dry_run else (64, 4096)))
