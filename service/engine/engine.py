"""The one owner of device work on the pool: K/V writes, copy-on-write page copies, attention.

The core hands out slots and pages; every write into `blocks` and every attention call goes
through here, under one lock, so requests never race on the pool.

Backends: "torch" runs the references in kernels/reference.py; "cpu" (auto on a CPU pool) the same,
but a decode batch of a float32 pool in compiled C (kernels/cpu_decode.py); "triton" runs the kernels
in kernels/ (store, decode when every sequence has one query, prefill otherwise). On the CPU the
triton backend runs them in Triton's interpreter (slow, but the same code path as on a GPU).
"""

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any, TypeVar

import torch

from kernels.batched_reference import one_query_per_sequence, paged_attention_batched, store_kv_direct
from kernels.cpu_decode import paged_attention_cpu
from service.engine.formats import format_pages
from service.engine.storage import Storage

T = TypeVar("T")


class Engine:
    def __init__(self, storage: Storage, backend: str = "auto") -> None:
        self.storage = storage
        self.blocks = storage.blocks
        self.device = storage.device
        # FP8 (blocks + scales) and MLA (latent) pools have their own store and attention paths, whose
        # CPU side is the torch reference: the cpu backend's compiled decode is for plain K/V pools.
        special = storage.scales is not None or storage.mla
        if backend == "auto":
            backend = "triton" if self.device.type != "cpu" else "torch" if special else "cpu"
        if backend == "cpu" and self.device.type != "cpu":
            raise RuntimeError(f"attention backend 'cpu' runs on a CPU pool, not on {self.device}")
        self.backend = backend
        self.lock = threading.Lock()
        # Device work runs on one worker thread, in submission order (FIFO), never on the event loop.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-device")
        if self.backend == "triton" and self.device.type == "cpu":
            # Triton reads TRITON_INTERPRET when @triton.jit decorates, so set it before any kernel
            # module is imported: CPU tensors can only run through the interpreter.
            os.environ["TRITON_INTERPRET"] = "1"
        self.formats = format_pages(storage, self.backend)
        self._store: ModuleType | None = None
        self._decode: ModuleType | None = None
        self._prefill: ModuleType | None = None
        if self.backend == "triton" and self.formats is None:
            self._load_kernels()

    async def submit(self, job: Callable[[], T]) -> T:
        """Run `job` on the device worker and wait for it without blocking the event loop.

        A request submits one job, right after its bookkeeping and with no await in between: the worker
        runs jobs in submission order, so device work happens in the order the core handed out slots.
        """
        return await asyncio.get_running_loop().run_in_executor(self._worker, job)

    def close(self) -> None:
        self._worker.shutdown(wait=True)

    def _load_kernels(self) -> None:
        from kernels import decode, prefill, store

        self._store, self._decode, self._prefill = store, decode, prefill

    def _on_device(self) -> contextlib.AbstractContextManager[object]:
        """Triton launches on the current CUDA device: make it the pool's (cuda:1 and up)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole pages (all layers, K and V): the copy-on-write of shared partial pages."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], dtype=torch.int64, device=self.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.int64, device=self.device)
        with self.lock:
            self.blocks[dst] = self.blocks[src]
            if self.formats is not None:
                self.formats.copy_pages(src, dst)

    def write(self, k: torch.Tensor, v: torch.Tensor | None, slots: torch.Tensor, layer: int | None = None) -> None:
        """k, v: [L, T, H, D] (all layers) or [T, H, D] (one layer); slots: [T]. MLA: k only."""
        if self.formats is not None:
            k, slots = k.to(self.device), slots.to(self.device)
            with self.lock:
                self.formats.write(k, None if v is None else v.to(self.device), slots, layer)
            return
        assert v is not None
        k, v, slots = (t.to(self.device, non_blocking=True) for t in (k, v, slots))
        with self.lock, self._on_device():
            if self._store is not None:
                self._store.store_kv(self.blocks, k, v, slots, layer)
            else:
                store_kv_direct(self.blocks, k, v, slots, layer)

    def attend(
        self,
        q: torch.Tensor,
        layer: int,
        lookup_table: torch.Tensor,
        cache_lengths: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D] -> [T, Hq, D] in q's dtype ([T, Hq, kv_lora_rank] for an MLA pool)."""
        dev = self.device
        lut, cache_lengths, qsl = (t.to(dev) for t in (lookup_table, cache_lengths, query_start_loc))
        options: dict[str, Any] = {"scale": scale, "sliding_window": sliding_window, "softcap": softcap}
        with self.lock, self._on_device():
            if self.formats is not None:
                return self.formats.attend(q.to(dev), layer, lut, cache_lengths, qsl, **options)
            if self._decode is not None and self._prefill is not None:
                return self._attend_triton(q, layer, lut, cache_lengths, qsl, options)
            attention = paged_attention_cpu if self.backend == "cpu" else paged_attention_batched
            out = attention(q.to(dev), self.blocks, layer, lut, cache_lengths, qsl, **options)
        assert isinstance(out, torch.Tensor)
        return out

    def _attend_triton(
        self,
        q: torch.Tensor,
        layer: int,
        lut: torch.Tensor,
        cache_lengths: torch.Tensor,
        query_start_loc: torch.Tensor,
        options: dict[str, Any],
    ) -> torch.Tensor:
        """The kernels: decode when every sequence has one query, prefill otherwise (on the device)."""
        assert self._decode is not None and self._prefill is not None
        qd = q.to(self.device, self.blocks.dtype)  # the kernels take q in the pool's dtype
        if one_query_per_sequence(q, query_start_loc):  # a decode step
            out = self._decode.paged_decode(qd, self.blocks, layer, lut, cache_lengths, **options)
        else:
            out = self._prefill.paged_prefill(qd, self.blocks, layer, lut, cache_lengths, query_start_loc, **options)
        assert isinstance(out, torch.Tensor)
        return out.to(q.dtype)
