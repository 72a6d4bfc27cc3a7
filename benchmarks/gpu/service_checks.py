"""Issue 27's service part: a pool on the device served by `kvpool serve` on a loopback port and driven over
HTTP (plain, FP8 and MLA pools against the torch reference); a second process mapping it through
GET /v1/ipc (CUDA IPC on a GPU), writing K/V at served slots, the server attending over them, and PoolLost
after a restart; the host tier's spill and restore bit for bit, and the disk tier over HTTP; the vLLM
connector's GPU layout on device caches with the event ordering (connector_layout.py). Figures: HTTP
attend against the kernel in process, the IPC write against a device-to-device copy, the host tier's
restore against a pinned host-to-device copy. The dry run does the same on the CPU (memfd instead of
CUDA IPC) at tiny sizes and times nothing.
"""

import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.gpu.report import Report

PART = "service"


def wall_ms(fn: Callable[[], Any], device: torch.device, repeat: int) -> list[float]:
    """Milliseconds of each call, the device synchronized before the clock is read (what a caller waits)."""
    fn()
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - began) * 1e3)
    return times


def p50(report: Report, times: list[float]) -> float:
    return math.nan if report.dry_run else statistics.median(times)


def server_env(device: torch.device, **more: str) -> dict[str, str]:
    return {"KVPOOL_DEVICE": device.type, "KVPOOL_ATTENTION_BACKEND": "triton", **more}


def pool_checks(report: Report, device: torch.device) -> None:
    """create / append with K/V / step / attend / fork / free on plain, FP8 and MLA pools."""
    from kernels.reference_fp8 import dequantize_fp8, quantize_fp8
    from service.client import KVPoolClient
    from tests.conftest import Server
    from tests.kernels.paged_data import dense_attention

    dtype = "bfloat16" if device.type == "cuda" else "float32"
    geometry = {"KVPOOL_NUM_LAYERS": "2", "KVPOOL_PAGE_SIZE": "16", "KVPOOL_NUM_PAGES": "64", "KVPOOL_DTYPE": dtype}
    pools = {
        "plain": {"KVPOOL_NUM_KV_HEADS": "2", "KVPOOL_HEAD_DIM": "64"},
        "fp8": {"KVPOOL_NUM_KV_HEADS": "2", "KVPOOL_HEAD_DIM": "64", "KVPOOL_DTYPE": "float8_e4m3fn",
                "KVPOOL_QUANT_GRANULARITY": "32"},
        "mla": {"KVPOOL_NUM_KV_HEADS": "1", "KVPOOL_HEAD_DIM": "96", "KVPOOL_MLA": "1", "KVPOOL_KV_LORA_RANK": "64"},
    }  # fmt: skip
    torch_dtype = getattr(torch, dtype)
    for kind, env in pools.items():
        heads, dim = int(env["KVPOOL_NUM_KV_HEADS"]), int(env["KVPOOL_HEAD_DIM"])
        server = Server(server_env(device, **{**geometry, **env}))
        try:
            with KVPoolClient(server.url) as c:
                gen = torch.Generator().manual_seed(len(kind))
                lengths = {"a": 37, "b": 16}  # b ends on a page boundary
                kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
                for seq_id, n in lengths.items():
                    c.create_sequence(seq_id)
                    k = torch.randn(2, n, heads, dim, generator=gen).to(torch_dtype)
                    v = k if kind == "mla" else torch.randn(2, n, heads, dim, generator=gen).to(torch_dtype)
                    c.append(seq_id, num_tokens=n, k=k, v=None if kind == "mla" else v)
                    kv[seq_id] = (k, v)
                step = c.step([("a", 1), ("b", 1)])  # (seq_id, num_tokens)
                report.check(PART, f"{kind} pool: step gives one slot each", [len(s) for s in step.slots] == [1, 1])
                # The step's new positions hold no K/V yet: attend with them written by /v1/attend itself.
                q = torch.randn(2, 4 * heads if kind != "mla" else 8, dim, generator=gen).to(torch_dtype)
                k_new = torch.randn(2, heads, dim, generator=gen).to(torch_dtype)
                v_new = k_new if kind == "mla" else torch.randn(2, heads, dim, generator=gen).to(torch_dtype)
                for layer in (0, 1):
                    out = c.attend(layer, ["a", "b"], q, k=k_new, v=None if kind == "mla" else v_new)
                    errs = []
                    for i, (seq_id, n) in enumerate(lengths.items()):
                        k = torch.cat([kv[seq_id][0][layer], k_new[i : i + 1]]).float()
                        v = torch.cat([kv[seq_id][1][layer], v_new[i : i + 1]]).float()
                        if kind == "fp8":  # the reference reads what the pool holds: e4m3 values times scales
                            k, v = (dequantize_fp8(*quantize_fp8(t, 32)) for t in (k, v))
                        if kind == "mla":
                            v = v[..., :64]
                        want, _ = dense_attention(q[i : i + 1].float(), torch.tensor([n]), k, v)
                        errs.append(float((out[i : i + 1].double() - want).norm() / want.norm()))
                    report.check(PART, f"{kind} pool: HTTP attend layer {layer} = reference", max(errs) < 1e-2,
                                 rel_err=max(errs))  # fmt: skip
                child = c.fork("a", "a2")
                same = torch.equal(c.attend(1, ["a2"], q[:1]), c.attend(1, ["a"], q[:1]))
                report.check(PART, f"{kind} pool: a fork attends as its parent", child.seq_id == "a2" and same)
                for seq_id in ("a", "a2", "b"):
                    c.free(seq_id)
                report.check(PART, f"{kind} pool: every page back after free", c.pool()["pages_used"] == 0)
        finally:
            server.stop()


def ipc_checks(report: Report, device: torch.device) -> None:
    """A client process maps the pool, writes K/V at served slots; the server attends over them; latency and
    bandwidth figures; PoolLost after a restart."""
    from benchmarks.gpu.cases import paged_batch
    from kernels.decode import paged_decode
    from service.client import KVPoolClient, PoolLost
    from tests.conftest import Server

    batch, ctx, hq, hkv, dim = (32, 4096, 32, 8, 128) if not report.dry_run else (4, 40, 4, 2, 16)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pages = batch * -(-ctx // 16) + 16
    geometry = {"KVPOOL_NUM_LAYERS": "1", "KVPOOL_NUM_KV_HEADS": str(hkv), "KVPOOL_HEAD_DIM": str(dim)}
    geometry |= {"KVPOOL_PAGE_SIZE": "16", "KVPOOL_NUM_PAGES": str(pages), "KVPOOL_DTYPE": str(dtype)[len("torch.") :]}
    env = server_env(device, **geometry)
    server = Server(env)
    try:
        with KVPoolClient(server.url) as c:
            kind = c.ipc()["kind"]
            report.check(
                PART, "GET /v1/ipc kind", kind == ("cuda_ipc" if device.type == "cuda" else "memfd"), kind=kind
            )
            seqs = [f"s{i}" for i in range(batch)]
            slots = []
            for s in seqs:
                c.create_sequence(s)
                slots.append(c.append(s, num_tokens=ctx).slots)
            # The served slots, once on the device, as a frontend holds them (its writes then check them there).
            flat = torch.tensor([x for row in slots for x in row], device=device)
            gen = torch.Generator(device).manual_seed(5)
            k = torch.randn(len(flat), hkv, dim, generator=gen, device=device).to(dtype)
            v = torch.randn(len(flat), hkv, dim, generator=gen, device=device).to(dtype)
            with c.attach() as pool:
                write = wall_ms(lambda: pool.write(k, v, flat, layer=0), device, 5 if not report.dry_run else 1)
                copy_src = torch.cat([k, v]).reshape(-1)
                copy_dst = torch.empty_like(copy_src)
                copy = wall_ms(lambda: copy_dst.copy_(copy_src), device, 5 if not report.dry_run else 1)
                nbytes = 2 * k.nbytes
                ipc_gbs = report.figure(PART, f"IPC write of {nbytes / 2**20:.0f} MiB K/V at served slots",
                                        nbytes / p50(report, write) / 1e6, "GB/s (bytes written)")  # fmt: skip
                d2d_gbs = 2 * nbytes / p50(report, copy) / 1e6
                d2d = report.figure(PART, "device-to-device copy of the same bytes", d2d_gbs, "GB/s (read + write)")
                # The IPC write reads K/V and writes the pool: read + write, as the copy is counted.
                report.target("IPC write / device-to-device copy", 2 * ipc_gbs / d2d if ipc_gbs and d2d else None,
                              ">=", 0.7, "x")  # fmt: skip
                q = torch.randn(batch, hq, dim, generator=gen, device=device).to(dtype)
                out = c.attend(0, seqs, q.cpu())
                want = _dense_decode(q, k, v, batch, ctx)
                err = float((out.to(device).double() - want).norm() / want.norm())
                report.check(PART, "server attends over the client's writes = reference", err < 1e-2, rel_err=err)
                http = wall_ms(lambda: c.attend(0, seqs, q.cpu()), device, 30 if not report.dry_run else 1)
                local = paged_batch([ctx] * batch, 16, hkv, dim, dtype, device, seed=6)
                cache = torch.full((batch,), ctx - 1, dtype=torch.int32, device=device)
                kernel = wall_ms(lambda: paged_decode(q, local.blocks, 0, local.lookup_table, cache), device, 30)
                name = f"decode B={batch} ctx={ctx}"
                h = report.figure(PART, f"HTTP attend {name} p50", p50(report, http), "ms")
                kern = report.figure(PART, f"in-process kernel {name} p50", p50(report, kernel), "ms")
                report.target(
                    "HTTP attend p50 - in-process kernel p50", h - kern if h and kern else None, "<=", 1.0, "ms"
                )
                server.stop()
                second = Server(env)
                try:
                    with KVPoolClient(second.url) as c2:
                        try:
                            c2.check_attached(pool)
                            lost = False
                        except PoolLost:
                            lost = True
                    report.check(PART, "after a server restart the mapped pool is reported lost (PoolLost)", lost)
                finally:
                    second.stop()
    finally:
        server.stop()


def _dense_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, ctx: int) -> torch.Tensor:
    """float32 on the device. q [B, Hq, D]; k, v [B * ctx, Hkv, D] in sequence order -> [B, Hq, D] float64."""
    group = q.shape[1] // k.shape[1]
    k = k.view(batch, ctx, *k.shape[1:]).float().repeat_interleave(group, 2)  # [B, ctx, Hq, D]
    v = v.view(batch, ctx, *v.shape[1:]).float().repeat_interleave(group, 2)
    s = torch.einsum("bhd,bthd->bht", q.float(), k) / math.sqrt(q.shape[2])
    return torch.einsum("bht,bthd->bhd", s.softmax(-1), v).double()


def tier_checks(report: Report, device: torch.device) -> None:
    """The host tier in process (pinned on a GPU): spill, poison, restore bit for bit, timed against a pinned
    host-to-device copy; the disk tier over HTTP, every prompt back from it bit for bit."""
    from service.config import Settings
    from service.engine.engine import DeviceEngine
    from service.engine.storage import Storage
    from service.tiers.pages import PageCodec
    from service.tiers.spill import HostTier
    from tests.conftest import SMALL_POOL, Server
    from tests.tiers.helpers import run_prompt, same_bits

    pages = 1024 if not report.dry_run else 16
    settings = Settings(num_layers=8, num_kv_heads=8, head_dim=128, page_size=16, num_pages=pages + 1,
                        dtype="bfloat16" if device.type == "cuda" else "float32", device=device.type)  # fmt: skip
    storage = Storage(settings)
    try:
        storage.blocks.copy_(torch.randn(storage.blocks.shape, device=device).to(storage.blocks.dtype))
        codec = PageCodec(storage)
        engine = DeviceEngine(storage)  # (the tier's jobs are run here directly, timed)
        tier = HostTier(codec, engine, codec.page_nbytes * pages, None)  # pinned on a GPU
        ids = torch.randperm(pages).tolist()
        slots = list(range(pages))
        tier.copy_down_job(ids, slots)()
        before = storage.blocks[ids].clone()
        storage.blocks[ids] = 0
        restore = wall_ms(tier.read_job(slots, ids), device, 5 if not report.dry_run else 1)
        same = torch.equal(storage.blocks[ids].view(torch.int16), before.view(torch.int16))
        report.check(PART, f"host tier: {pages} spilled pages restored bit for bit", same)
        nbytes = codec.page_nbytes * pages
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        dest = torch.empty(nbytes, dtype=torch.uint8, device=device)
        h2d = wall_ms(lambda: dest.copy_(host, non_blocking=True), device, 5 if not report.dry_run else 1)
        name = f"{nbytes / 2**20:.0f} MiB, permuted pages"
        tier_gbs = report.figure(PART, f"host tier restore ({name})", nbytes / p50(report, restore) / 1e6, "GB/s")
        pinned = report.figure(PART, "pinned host-to-device copy of the same bytes", nbytes / p50(report, h2d) / 1e6,
                               "GB/s")  # fmt: skip
        report.target("host tier restore / pinned H2D copy", tier_gbs / pinned if tier_gbs and pinned else None,
                      ">=", 0.7, "x")  # fmt: skip
        tier.close()
        engine.close()
    finally:
        storage.close()
    with tempfile.TemporaryDirectory() as spill_dir:
        env = {**SMALL_POOL, **server_env(device), "KVPOOL_SPILL": "disk", "KVPOOL_SPILL_PATH": spill_dir,
               "KVPOOL_SPILL_BYTES": str(64 * 2200)}  # fmt: skip
        server = Server(env)
        try:
            prompts = 8 if report.dry_run else 16  # 4 pages each: 2x or 4x the device pool's 16
            first = [run_prompt(server.client, f"s{i}", i) for i in range(prompts)]
            second = [run_prompt(server.client, f"s{i}", i) for i in range(prompts)]
            hits = [cached for cached, _ in second]
            same = all(same_bits(a, b) for (_, a), (_, b) in zip(first, second))
            name = f"disk tier: {prompts} prompts (4 pages each, the device pool 16) back from disk bit for bit"
            report.check(PART, name, hits == [16] * prompts and same, hits=str(hits))
        finally:
            server.stop()


def run(report: Report, device: torch.device) -> None:
    from benchmarks.gpu.connector_layout import layout_checks

    os.environ.setdefault("KVPOOL_LOG_LEVEL", "warning")
    for name, fn in (("pools", pool_checks), ("ipc", ipc_checks), ("tiers", tier_checks), ("layout", layout_checks)):
        try:
            fn(report, device)
        except Exception as exc:  # one area's failure must not hide the others'
            report.check(PART, f"{name} raised", False, error=f"{type(exc).__name__}: {exc}"[:300])
