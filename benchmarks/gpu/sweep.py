"""Every Triton kernel against its torch reference (kernels/reference*.py) on the device, over issue 26's
sweep: bf16 and fp16; GQA 32/8, 8/8, 64/8; head_dim 64, 128, 256 (MLA 512 + 64); pages of 16, 64, 128
tokens; contexts 1 to 32k with lengths off the page; permuted pages; sliding window, softcap, LSE;
batch 1 to 256.

Not the cross product (each distinct shape compiles its own kernel): one factor at a time around the
base (bf16, 32/8, D 128, page 16), every dtype x page pair, and each configuration over three batches:
`ragged` (8 sequences from 1 token to 32k, lengths on and off the page), `wide` (256 short sequences)
and `long` (1 sequence of 32k - 3: the split-KV path), with sliding window + softcap on the ragged one
(and forced split counts on the base).

Tolerances, on outputs poisoned with NaN before each run (a NaN left fails): attention out and LSE,
||got - ref|| / ||ref|| < 1e-2 against the reference's float32 arithmetic on the same 16-bit (or FP8)
inputs; stores bit for bit, except FP8 values within e4m3's rounding of the reference's (scales exact).
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from benchmarks.gpu.cases import fp8_scales, paged_batch, query_split, rel_error
from benchmarks.gpu.report import Report
from kernels.options import AttendOptions

TOL = 1e-2
BF16, FP16 = torch.bfloat16, torch.float16
WINDOW_SOFTCAP: AttendOptions = {"sliding_window": 1000, "softcap": 30.0}


@dataclass
class Scale:
    """The sweep's sizes: the GPU's, or the dry run's (the interpreter on the CPU)."""

    pages: tuple[int, ...]
    gqa: tuple[tuple[int, int], ...]  # (query heads, KV heads); the first is the base
    dims: tuple[int, ...]  # head_dim; the second is the base
    batches: dict[str, list[int]]  # name -> lengths (tokens per sequence); filled per page size
    new_tokens: list[int]  # prefill: queries per sequence (the last ones)
    mla: tuple[int, int, tuple[int, ...]]  # (kv_lora_rank, rope dims, query heads)
    fp8_group: int


def gpu_scale(page: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(page)
    ragged = [1, page - 1, page, page + 1, 3 * page + 5, 1000, 4097, 32768]
    return {"ragged": ragged, "wide": torch.randint(1, 300, (256,), generator=gen).tolist(), "long": [32768 - 3]}


def dry_scale(page: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(page)
    wide = torch.randint(1, 9, (6,), generator=gen).tolist()
    return {"ragged": [1, page - 1, page, page + 1, 2 * page + 3], "wide": wide, "long": [5 * page + 1]}


GPU = Scale((16, 64, 128), ((32, 8), (8, 8), (64, 8)), (64, 128, 256), {}, [1, 15, 16, 17, 100, 513, 1000, 2048],
            (512, 64, (16, 128)), 128)  # fmt: skip
DRY = Scale((4,), ((4, 2), (2, 2)), (64,), {}, [1, 2, 3, 4, 5], (32, 16, (4,)), 16)


def configs(s: Scale) -> list[tuple[torch.dtype, int, int, int, int]]:
    """(dtype, page, Hq, Hkv, D): every dtype x page at the base heads and dim, then each other GQA and dim."""
    (hq, hkv), d = s.gqa[0], s.dims[1 if len(s.dims) > 1 else 0]
    out = [(dtype, page, hq, hkv, d) for dtype in (BF16, FP16) for page in s.pages]
    out += [(BF16, s.pages[0], q, k, d) for q, k in s.gqa[1:]]
    out += [(BF16, s.pages[0], hq, hkv, other) for other in s.dims if other != d]
    return out


class Sweep:
    def __init__(self, report: Report, device: torch.device, scale: Scale) -> None:
        self.report, self.device, self.s = report, device, scale
        self.worst: dict[str, float] = {}

    def batches(self, page: int) -> dict[str, list[int]]:
        return (dry_scale if self.report.dry_run else gpu_scale)(page)

    def record(self, kernel: str, name: str, err: float, tol: float = TOL) -> None:
        self.worst[kernel] = max(self.worst.get(kernel, 0.0), err)
        self.report.check("kernels", f"{kernel} {name}", err < tol, rel_err=err, tol=tol)

    def q(self, rows: int, heads: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
        gen = torch.Generator(self.device).manual_seed(seed)
        return torch.randn(rows, heads, dim, generator=gen, device=self.device).to(dtype)

    def decode(self, dtype: torch.dtype, page: int, hq: int, hkv: int, d: int) -> None:
        from kernels.decode import paged_decode
        from kernels.reference import paged_decode_ref

        for bname, lengths in self.batches(page).items():
            b = paged_batch(lengths, page, hkv, d, dtype, self.device, seed=len(lengths) + page + d)
            cache = torch.tensor([n - 1 for n in lengths], dtype=torch.int32, device=self.device)
            q = self.q(len(lengths), hq, d, dtype, seed=d)
            runs: list[tuple[AttendOptions, int | None]] = [({}, None)]
            if bname == "ragged":
                runs.append((WINDOW_SOFTCAP, None))
                if (dtype, page, hq, hkv, d) == configs(self.s)[0]:  # the base: forced split counts, 16 and none
                    runs += [({}, 16), ({}, 1)]
            for options, splits in runs:
                out = torch.full_like(q, float("nan"))
                lse = torch.full(q.shape[:2], float("nan"), device=self.device)
                paged_decode(q, b.blocks, 0, b.lookup_table, cache, return_lse=True, out=out, lse=lse,
                             num_splits=splits, **options)  # fmt: skip
                ref_out, ref_lse = paged_decode_ref(q, b.blocks, 0, b.lookup_table, cache, return_lse=True, **options)
                name = f"{_name(dtype, page, hq, hkv, d)} {bname} B={len(lengths)} splits={splits or 'auto'} {options}"
                self.record("decode", name, rel_error(out, ref_out))
                self.record("decode lse", name, rel_error(lse, ref_lse))

    def prefill(self, dtype: torch.dtype, page: int, hq: int, hkv: int, d: int) -> None:
        from kernels.prefill import paged_prefill
        from kernels.reference import paged_attention_ref

        for bname, lengths in self.batches(page).items():
            b = paged_batch(lengths, page, hkv, d, dtype, self.device, seed=len(lengths) + page + d + 1)
            new = (self.s.new_tokens * len(lengths))[: len(lengths)]
            cache, qsl, _ = query_split(lengths, new, self.device)
            q = self.q(int(qsl[-1]), hq, d, dtype, seed=d + 1)
            option_sets: list[AttendOptions] = [{}, WINDOW_SOFTCAP] if bname == "ragged" else [{}]
            for options in option_sets:
                out = torch.full_like(q, float("nan"))
                lse = torch.full(q.shape[:2], float("nan"), device=self.device)
                paged_prefill(q, b.blocks, 0, b.lookup_table, cache, qsl, return_lse=True, out=out, lse=lse, **options)
                ref = paged_attention_ref(q, b.blocks, 0, b.lookup_table, cache, qsl, return_lse=True, **options)
                name = f"{_name(dtype, page, hq, hkv, d)} {bname} B={len(lengths)} T={q.shape[0]} {options}"
                self.record("prefill", name, rel_error(out, ref[0]))
                self.record("prefill lse", name, rel_error(lse, ref[1]))

    def attention_fp8(self, page: int, hq: int, hkv: int, d: int) -> None:
        from kernels.attention_fp8 import paged_attention_fp8
        from kernels.reference_fp8 import paged_attention_fp8_ref

        group = min(self.s.fp8_group, d)
        for bname in ("ragged", "wide"):
            lengths = self.batches(page)[bname]
            b = paged_batch(lengths, page, hkv, d, torch.float8_e4m3fn, self.device, seed=page + d + 2)
            scales = fp8_scales(b.blocks, group, torch.float32, seed=page)
            for what, new in (("decode", [1] * len(lengths)), ("prefill", self.s.new_tokens)):
                cache, qsl, max_q = query_split(lengths, (new * len(lengths))[: len(lengths)], self.device)
                q = self.q(int(qsl[-1]), hq, d, BF16, seed=d + 2)
                options: AttendOptions = WINDOW_SOFTCAP if what == "prefill" else {}
                out = torch.full_like(q, float("nan"))
                paged_attention_fp8(q, b.blocks, scales, 0, b.lookup_table, cache, qsl, max_q_len=max_q, out=out,
                                    **options)  # fmt: skip
                ref = paged_attention_fp8_ref(q, b.blocks, scales, 0, b.lookup_table, cache, qsl, **options)
                name = f"{_name(BF16, page, hq, hkv, d)} kv fp8/{group} {bname} {what} {options}"
                self.record("attention fp8", name, rel_error(out, ref))

    def mla(self, page: int, hq: int) -> None:
        from kernels.mla import mla_attention
        from kernels.reference_mla import mla_attention_ref

        rank, rope = self.s.mla[0], self.s.mla[1]
        for bname in ("ragged", "wide"):
            lengths = self.batches(page)[bname]
            b = paged_batch(lengths, page, 1, rank + rope, BF16, self.device, seed=page + hq + 3, kv=1)
            for what, new in (("decode", [1] * len(lengths)), ("prefill", self.s.new_tokens)):
                cache, qsl, max_q = query_split(lengths, (new * len(lengths))[: len(lengths)], self.device)
                q = self.q(int(qsl[-1]), hq, rank + rope, BF16, seed=hq)
                out = torch.full((q.shape[0], hq, rank), float("nan"), dtype=BF16, device=self.device)
                mla_attention(q, b.blocks, 0, b.lookup_table, cache, qsl, rank, max_q_len=max_q, out=out)
                ref = mla_attention_ref(q, b.blocks, 0, b.lookup_table, cache, qsl, rank)
                self.record("mla", f"Hq={hq} {rank}+{rope} page={page} {bname} {what}", rel_error(out, ref))

    def stores(self, dtype: torch.dtype, page: int, hkv: int, d: int) -> None:
        """store_kv and store_latent bit for bit; store_kv_fp8: scales exact, values within e4m3 rounding."""
        from kernels.mla import store_latent
        from kernels.reference import store_kv_ref
        from kernels.reference_fp8 import store_kv_fp8_ref
        from kernels.reference_mla import store_latent_ref
        from kernels.store import store_kv
        from kernels.store_fp8 import store_kv_fp8

        lengths = self.batches(page)["ragged"]
        b = paged_batch(lengths, page, hkv, d, dtype, self.device, seed=page + d + 4)
        # Slots of every sequence's tokens, shuffled, with a skipped one (-1) among them.
        slots = b.slots[torch.randperm(len(b.slots), device=self.device)][:4096].clone()
        slots[0] = -1
        k, v = self.q(len(slots), hkv, d, torch.float32, 5), self.q(len(slots), hkv, d, torch.float32, 6)
        name = f"{_name(dtype, page, 0, hkv, d)} T={len(slots)}"
        got, want = b.blocks.clone(), b.blocks.clone()
        store_kv(got, k.to(dtype), v.to(dtype), slots, layer=0)
        store_kv_ref(want, k.to(dtype), v.to(dtype), slots, layer=0)
        self.record("store", name + " bit for bit", 0.0 if torch.equal(got, want) else float("inf"))
        if dtype != BF16:
            return
        group = min(self.s.fp8_group, d)
        for scale_dtype in (torch.float32, BF16):
            fp8 = b.blocks.to(torch.float8_e4m3fn)
            scales = fp8_scales(fp8, group, scale_dtype, seed=7)
            got_b, got_s, want_b, want_s = fp8.clone(), scales.clone(), fp8.clone(), scales.clone()
            store_kv_fp8(got_b, got_s, k, v, slots, layer=0)
            store_kv_fp8_ref(want_b, want_s, k, v, slots, layer=0)
            exact = torch.equal(got_b.view(torch.uint8), want_b.view(torch.uint8))
            close = torch.allclose(got_b.float(), want_b.float(), atol=2**-9, rtol=2**-3)
            err = 0.0 if torch.equal(got_s, want_s) and close else float("inf")
            self.record("store fp8", f"{name} scales {scale_dtype} values bit-exact={exact}", err)
        latent = self.q(len(slots), 1, sum(self.s.mla[:2]), BF16, 8)
        lat = paged_batch(lengths, page, 1, sum(self.s.mla[:2]), BF16, self.device, seed=9, kv=1)
        got, want = lat.blocks.clone(), lat.blocks.clone()
        mla_slots = lat.slots[: len(slots)]
        store_latent(got, latent, mla_slots, layer=0)
        store_latent_ref(want, latent, mla_slots, layer=0)
        self.record(
            "store latent", f"page={page} T={len(slots)} bit for bit", 0.0 if torch.equal(got, want) else float("inf")
        )


def _name(dtype: torch.dtype, page: int, hq: int, hkv: int, d: int) -> str:
    return f"{str(dtype).removeprefix('torch.')} page={page} {hq}/{hkv} D={d}"


def run(report: Report, device: torch.device) -> None:
    scale = DRY if report.dry_run else GPU
    sweep = Sweep(report, device, scale)
    steps: list[tuple[str, Callable[[], None]]] = []
    for dtype, page, hq, hkv, d in configs(scale):
        name = _name(dtype, page, hq, hkv, d)
        steps.append((f"stores {name}", partial(sweep.stores, dtype, page, hkv, d)))
        steps.append((f"decode {name}", partial(sweep.decode, dtype, page, hq, hkv, d)))
        steps.append((f"prefill {name}", partial(sweep.prefill, dtype, page, hq, hkv, d)))
        if dtype == BF16:
            steps.append((f"attention fp8 {name}", partial(sweep.attention_fp8, page, hq, hkv, d)))
    for page in scale.pages:
        for hq in scale.mla[2]:
            steps.append((f"mla Hq={hq} page={page}", partial(sweep.mla, page, hq)))
    if report.sweep_only:  # --sweep-only: the steps whose names hold one of these (a rerun of what was cut)
        steps = [(what, step) for what, step in steps if any(part in what for part in report.sweep_only)]
        report.say(f"  --sweep-only {report.sweep_only}: {[what for what, _ in steps]}")
    # The sweep may take 35% of the budget (its compiles dominate): the figures, the service and the GPU tests
    # still run (session 15's run: the sweep took 45%, and `pytest -m gpu`, ~80 s, got 56 s).
    stop_at = report.left_s() - 0.35 * report.budget_s
    for what, step in steps:
        if report.left_s() < stop_at and not report.dry_run:
            report.check("kernels", f"sweep cut short by the time guard before {what}", False)
            break
        try:
            step()
        except Exception as exc:  # one shape's failure (a compile error, say) must not hide the others'
            report.check("kernels", f"{what} raised", False, error=f"{type(exc).__name__}: {exc}"[:300])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report.data["kernel_worst_rel_error"] = sweep.worst
    report.say(f"  worst relative error per kernel: { {k: f'{v:.2e}' for k, v in sweep.worst.items()} }")
