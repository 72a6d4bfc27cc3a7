"""`python -m benchmarks.kernels.bench --tune`: the launch settings of the target shapes, swept in one call, so a
GPU session can pick the defaults from one table. Every variant's output is checked against the
default's (a broken setting shows as an error, not as a fast time)."""

import itertools
from typing import Any

import torch


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _sweep(name: str, run: Any, variants: list[dict[str, Any]], median_ms: Any) -> None:
    """run(**variant) -> output tensor; prints ms and the error against the default settings."""
    reference = run().clone()
    base = median_ms(run)
    print(f"\n{name}: default {base * 1e3:.1f} us")
    print(f"  {'variant':<56}{'us':>9}{'x default':>11}{'rel err':>10}")
    for variant in variants:
        label = " ".join(f"{k}={v}" for k, v in variant.items())
        try:
            out = run(**variant)
            err = _rel_err(out, reference)
            ms = median_ms(lambda v=variant: run(**v))
        except Exception as exc:  # a setting the compiler or the GPU refuses (e.g. too much shared memory)
            print(f"  {label:<56}  failed: {type(exc).__name__}: {str(exc)[:60]}")
            continue
        flag = "" if err < 2e-2 else "  WRONG"
        print(f"  {label:<56}{ms * 1e3:>9.1f}{base / ms:>11.2f}{err:>10.1e}{flag}", flush=True)


def tune(median_ms: Any) -> None:
    from benchmarks.kernels.peers import DTYPE, HEAD_DIM, NUM_Q_HEADS, make_case
    from kernels.decode import paged_decode
    from kernels.prefill import paged_prefill

    dev = torch.device("cuda")
    for batch, ctx in ((64, 4096), (1, 32768), (8, 8192)):
        case = make_case(batch, ctx, 16, dev)
        q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=dev)
        cache_lengths = torch.full((batch,), ctx - 1, dtype=torch.int32, device=dev)

        def run_decode(c: Any = case, q: torch.Tensor = q, cl: torch.Tensor = cache_lengths, **kw: Any) -> Any:
            return paged_decode(q, c.blocks, 0, c.lookup_table, cl, **kw)

        grid = itertools.product((32, 64, 128), (4, 8), (2, 3, 4))
        variants = [{"block_n": n, "num_warps": w, "num_stages": s} for n, w, s in grid]
        if batch * 8 < 132:
            variants += [{"num_splits": s} for s in (4, 8, 16, 32)]
        _sweep(f"decode page 16 batch {batch} ctx {ctx}", run_decode, variants, median_ms)
        del case

    batch, new = 4, 2048
    case = make_case(batch, new, 16, dev)
    q = torch.randn(batch * new, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=dev)
    cache_lengths = torch.zeros(batch, dtype=torch.int32, device=dev)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev) * new

    def run_prefill(**kw: Any) -> Any:
        return paged_prefill(q, case.blocks, 0, case.lookup_table, cache_lengths, qsl, **kw)

    tiles = itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))
    variants = [{"block_m": m, "block_n": n, "num_warps": w, "num_stages": s} for m, n, w, s in tiles]
    _sweep(f"prefill page 16 batch {batch} new {new}", run_prefill, variants, median_ms)
