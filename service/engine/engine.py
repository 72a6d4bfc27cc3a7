"""The one owner of device work on the pool: K/V writes, copy-on-write page copies, attention.

The core hands out slots and pages on the event loop; every write into `blocks`, every page copy and
every attention call goes through here and runs in the order it was submitted: on ONE worker thread,
or, for a small job while that worker is idle, at once on the event loop.

Decisions:
- One worker thread, no lock. The worker serializes device work, so requests never race on the pool,
  and a long attention call never stalls the event loop (`/healthz`, `/metrics`, bookkeeping routes).
  A lock beside a single worker could never be contended, so there is none; instead `write`, `attend`
  and `copy_pages` assert that they run on the worker, which turns a device call from the event loop
  (the bug this design removes) into an immediate error.
- FIFO is the ordering contract: a request submits its one job right after its bookkeeping, with no
  await in between, so the device sees writes and copies in the order the core handed out slots.
- Small jobs run at once, on the event loop, when nothing is queued or running on the worker
  (`submit(job, inline=engine.fits_inline(flops, nbytes))`): a decode attention of a few sequences, a
  K/V write of a few tokens, a page copy. Under load the hop to the worker and back, and the two
  threads taking turns at the GIL, cost far more than such a job (`kvpool bench http`: measured in
  docs/benchmarks.md, "Figures behind the code"). Running one only when the worker is idle keeps the FIFO order
  (nothing is ahead of it), and the bounds keep the loop's stall to about a millisecond; anything
  larger (a long prefill, a big write) goes to the worker, so /healthz never waits for it.
- A submitted job always runs, even if its caller is cancelled (a client that disconnects): the core
  has already committed the bookkeeping the job completes, and a skipped copy-on-write would leave a
  page that the sequence's table claims holds data it does not.
- The backend (service/engine/backends.py) is picked once, here, at start.
- On CUDA the worker makes the pool's device its current one once, when it starts, so Triton launches
  land on the pool's GPU (cuda:1 and up) without a context switch per call.
"""

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar, Unpack

import torch

from kernels.options import AttendOptions
from service.engine.backends import Backend, select_backend
from service.engine.storage import Storage

T = TypeVar("T")


class DeviceEngine:
    def __init__(self, storage: Storage, backend: str = "auto") -> None:
        self.storage = storage
        self.blocks = storage.blocks
        self.device = storage.device
        self.impl: Backend = select_backend(storage, backend)
        self.backend: str = self.impl.name  # triton | cpu | torch, as /v1/pool and the metrics report it
        self._worker_thread: threading.Thread | None = None
        self._pending = 0  # jobs submitted to the worker and not settled yet (read and written on the loop)
        self._inline_thread: threading.Thread | None = None  # the loop's thread while it runs a job inline
        self._closed = False
        self._worker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvpool-device", initializer=self._start_worker
        )

    def _start_worker(self) -> None:
        self._worker_thread = threading.current_thread()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # per thread: this worker's launches go to the pool's GPU

    def _pool_device(self) -> contextlib.AbstractContextManager[object]:
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _on_worker(self) -> bool:
        current = threading.current_thread()
        return current is self._worker_thread or current is self._inline_thread

    # Bounds of a job that may run inline (see the module docstring): about a millisecond of work.
    INLINE_MAX_FLOPS = 1 << 23  # attention: 4 * q heads * head_dim * (query, key) pairs
    INLINE_MAX_BYTES = 1 << 22  # K/V written, pages copied

    def fits_inline(self, flops: int = 0, nbytes: int = 0) -> bool:
        return flops <= self.INLINE_MAX_FLOPS and nbytes <= self.INLINE_MAX_BYTES

    def submit(self, job: Callable[[], T], inline: bool = False) -> "asyncio.Future[T]":
        """Queue `job` on the device worker now (or run it inline, below); await the result without
        blocking the event loop.

        The job is queued when submit is called (not when the result is awaited), and runs even if the
        awaiting task is cancelled. Its exception, if any, reaches the awaiting caller; the worker goes on.
        inline: the job is small (fits_inline): it runs at once, here, if nothing is queued or running.
        """
        loop = asyncio.get_running_loop()
        result: asyncio.Future[T] = loop.create_future()
        if self._closed:
            raise RuntimeError("the engine is closed")
        if inline and self._pending == 0:  # the worker is idle: nothing is ahead of this job
            self._inline_thread = threading.current_thread()
            try:
                with self._pool_device():  # the worker selected it once; the loop's thread has not
                    result.set_result(job())
            except Exception as exc:
                result.set_exception(exc)
            finally:
                self._inline_thread = None
            return result
        self._pending += 1

        def settle(done: "concurrent.futures.Future[T]") -> None:  # on the event loop
            self._pending -= 1
            if result.cancelled():
                return
            error = done.exception()
            if error is not None:
                result.set_exception(error)
            else:
                result.set_result(done.result())

        def hand_back(done: "concurrent.futures.Future[T]") -> None:  # on the worker
            try:
                loop.call_soon_threadsafe(settle, done)
            except RuntimeError:  # the loop closed while the job ran: nobody is waiting
                pass

        self._worker.submit(job).add_done_callback(hand_back)
        return result

    def call(self, job: Callable[[], T]) -> T:
        """Run `job` on the device worker and wait for it: for callers without an event loop (tests, tools)."""
        assert not self._on_worker(), "a job on the device worker cannot wait for the worker"
        return self._worker.submit(job).result()

    def close(self) -> None:
        """Let queued jobs finish, then stop the worker (idempotent); later submits raise RuntimeError."""
        self._closed = True
        self._worker.shutdown(wait=True)

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole pages (all layers, K and V, FP8 scales): the copy-on-write of shared partial pages."""
        assert self._on_worker(), "device work runs on the engine's worker: use submit() or call()"
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], dtype=torch.int64, device=self.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.int64, device=self.device)
        self.impl.copy_pages(src, dst)

    def write(self, k: torch.Tensor, v: torch.Tensor | None, slots: torch.Tensor, layer: int | None = None) -> None:
        """k, v: [L, T, H, D] (all layers) or [T, H, D] (one layer); slots: [T]. MLA: k only."""
        assert self._on_worker(), "device work runs on the engine's worker: use submit() or call()"
        dev = self.device
        self.impl.write(k.to(dev), None if v is None else v.to(dev), slots.to(dev), layer)

    def save_slots(self, slots: torch.Tensor, layer: int) -> list[torch.Tensor]:
        """What the pool holds at `slots` of `layer`, K and V (and FP8 scales): for restore_slots, which puts it
        back when a write must be undone. Every pool tensor is [N+1, 2|1, L, P, ...]: each gives [T, 2|1, ...]."""
        assert self._on_worker(), "device work runs on the engine's worker: use submit() or call()"
        pages, offsets = self._pages_and_offsets(slots)
        return [t[pages, :, layer, offsets] for t in self._pool_tensors()]

    def restore_slots(self, slots: torch.Tensor, layer: int, saved: list[torch.Tensor]) -> None:
        assert self._on_worker(), "device work runs on the engine's worker: use submit() or call()"
        pages, offsets = self._pages_and_offsets(slots)
        for t, old in zip(self._pool_tensors(), saved, strict=True):
            t[pages, :, layer, offsets] = old

    def _pool_tensors(self) -> list[torch.Tensor]:
        return [self.blocks] if self.storage.scales is None else [self.blocks, self.storage.scales]

    def _pages_and_offsets(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        page_size = self.blocks.shape[3]
        slots = slots.to(self.device)
        return slots // page_size, slots % page_size

    def attend(
        self,
        q: torch.Tensor,
        layer: int,
        lookup_table: torch.Tensor,
        cache_lengths: torch.Tensor,
        query_start_loc: torch.Tensor,
        **options: Unpack[AttendOptions],
    ) -> torch.Tensor:
        """q: [T, Hq, D] -> [T, Hq, D] in q's dtype, on the pool's device ([T, Hq, kv_lora_rank] for MLA).

        options: scale, sliding_window, softcap (see kernels.options.AttendOptions).
        """
        assert self._on_worker(), "device work runs on the engine's worker: use submit() or call()"
        dev = self.device
        lut, cache_lengths, qsl = (t.to(dev) for t in (lookup_table, cache_lengths, query_start_loc))
        return self.impl.attend(q.to(dev), layer, lut, cache_lengths, qsl, **options)
