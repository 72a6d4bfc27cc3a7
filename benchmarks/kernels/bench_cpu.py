"""`python -m benchmarks.kernels.bench_cpu`: the cpu backend's compiled decode against the torch path it replaces,
side by side in one process, on one thread (as `kvpool serve` runs host-side torch work).

float32 pool, pages of 16 tokens randomly permuted, every sequence at the full context. Times are
medians over interleaved rounds (compiled, torch, compiled, ...), so a slow phase of the machine
hits both alike; "x" is torch / compiled.
"""

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kernels.batched_reference import paged_decode_batched
from kernels.cpu_decode import native, paged_decode_compiled

PAGE_SIZE = 16
# (batch, context, query heads, KV heads, head_dim)
SHAPES = [(1, 128, 8, 2, 64), (4, 256, 8, 2, 64), (4, 1024, 8, 2, 64), (16, 512, 32, 8, 128), (1, 4096, 32, 8, 128)]
QUICK_SHAPES = [(1, 128, 8, 2, 64), (4, 256, 8, 2, 64)]


def decode_case(
    batch: int, context: int, num_q_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, Hq, D], a one-layer pool, its lookup table and the positions: every sequence at `context` tokens."""
    gen = torch.Generator().manual_seed(batch * 7919 + context)
    per_seq = -(-context // PAGE_SIZE)
    num_pages = batch * per_seq
    blocks = torch.randn(num_pages + 1, 2, 1, PAGE_SIZE, num_kv_heads, head_dim, generator=gen)
    blocks[num_pages] = 0
    lut = torch.full((batch, per_seq + 16), num_pages, dtype=torch.int64)
    lut[:, :per_seq] = torch.randperm(num_pages, generator=gen).view(batch, per_seq)
    q = torch.randn(batch, num_q_heads, head_dim, generator=gen)
    return q, blocks, lut, torch.full((batch,), context - 1, dtype=torch.int64)


def paths(
    q: torch.Tensor, blocks: torch.Tensor, lut: torch.Tensor, positions: torch.Tensor
) -> list[Callable[[], object]]:
    """The compiled decode and the torch path it replaces, on the same case."""
    return [
        lambda: paged_decode_compiled(q, blocks, 0, lut, positions),
        lambda: paged_decode_batched(q, blocks, 0, lut, positions),
    ]


def rounds_us(fns: list[Callable[[], object]], budget_s: float) -> list[float]:
    """Median µs per call of each fn, timed in interleaved rounds for about budget_s in all."""
    for fn in fns:
        fn()  # warm
    samples: list[list[float]] = [[] for _ in fns]
    deadline = time.perf_counter() + budget_s
    while time.perf_counter() < deadline or len(samples[0]) < 5:
        for fn, out in zip(fns, samples):
            start = time.perf_counter()
            fn()
            out.append((time.perf_counter() - start) * 1e6)
    return [statistics.median(s) for s in samples]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels.bench_cpu", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two small shapes, briefly")
    args = parser.parse_args(argv)
    if native is None:
        print("kernels/_cpu_decode.c is not built: run `pip install -e .`")
        return 1
    torch.set_num_threads(1)
    budget = 0.3 if args.quick else 2.0
    print(f"{'batch':>5} {'context':>7} {'Hq/Hkv':>7} {'D':>4} {'compiled us':>12} {'torch us':>10} {'x':>6}")
    for shape in QUICK_SHAPES if args.quick else SHAPES:
        compiled, reference = rounds_us(paths(*decode_case(*shape)), budget)
        batch, context, hq, hkv, dim = shape
        heads = f"{hq}/{hkv}"
        print(f"{batch:>5} {context:>7} {heads:>7} {dim:>4} {compiled:>12.1f} {reference:>10.1f}", end=" ")
        print(f"{reference / compiled:>6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
