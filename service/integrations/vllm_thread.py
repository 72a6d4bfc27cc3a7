"""ConnectorThread, a connector's own thread (of either role: the scheduler's and each worker's connector have
one each, all called "kvpool-connector"): every kvpool call and K/V copy of that connector runs here, in order.

- One thread owns the connector's KVPoolLink (the worker's mapped pool is replaced on a reconnect: a
  load on one thread while another remaps would read unmapped memory), so nothing needs a lock around it.
- `run` jobs are waited for and go ahead of queued `submit` jobs, which are not waited for; a `call` job
  runs on the caller's thread when this one is idle (the scheduler's lookups and appends). Worker
  side: loads (the forward needs them) and saves (vLLM's step goes on while they run, and vLLM keeps a
  finished request's blocks until the connector reports its saves done, in get_finished). Scheduler
  side (`ordered`: every job in the order given, a waited-for one behind those submitted before it): lookups
  and the appends of saves (waited for), and the releases of pins and saves (not waited for), which must reach
  kvpool in order (a commit submitted before a call that frees the same sequence). At most `max_saves`
  submitted jobs wait; one more blocks the caller.
- Copies here run on one intra-op thread. vLLM's CPU worker keeps its OpenMP threads for the model;
  a parallel copy in vLLM's step stalls whenever one of those threads is descheduled, and one thread
  already reaches the memory bandwidth of a plain copy there (measured: docs/benchmarks.md, "Figures behind the code").
"""

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import torch

logger = logging.getLogger("service.integrations.vllm")
T = TypeVar("T")


class ConnectorThread:
    def __init__(self, max_saves: int, ordered: bool = False) -> None:
        self.max_saves, self.ordered = max_saves, ordered
        self._cv = threading.Condition()
        self._loads: deque[Callable[[], None]] = deque()
        self._saves: deque[Callable[[], None]] = deque()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._main, name="kvpool-connector", daemon=True)
        self._thread.start()

    def run(self, fn: Callable[[], T]) -> T:
        """fn() on the thread, ahead of queued saves (`ordered`: behind them); waits for it (and re-raises what it
        raised)."""
        done = threading.Event()
        out: list[T] = []
        err: list[BaseException] = []

        def job() -> None:
            try:
                out.append(fn())
            except BaseException as exc:  # handed to the caller
                err.append(exc)
            finally:
                done.set()

        self._put(self._saves if self.ordered else self._loads, job, limit=None)
        done.wait()
        if err:
            raise err[0]
        return out[0]

    def call(self, fn: Callable[[], T]) -> T:
        """fn() on the caller's thread if this one is idle (it starts nothing meanwhile: one thread at a time
        uses the link), else as run() does. The scheduler's lookups and appends: under load each hand-over
        to this thread and back waited for a core and the GIL, longer than the call to kvpool itself."""
        with self._cv:
            idle = not (self._loads or self._saves or self._busy or self._closed)
            if idle:
                self._busy = True
        if not idle:
            return self.run(fn)
        try:
            return fn()
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def submit(self, fn: Callable[[], None]) -> bool:
        """Queue fn() behind the other saves; waits while max_saves are queued. True if it had to wait."""
        return self._put(self._saves, fn, limit=self.max_saves)

    def drain(self) -> None:
        """Wait until every queued job has run."""
        with self._cv:
            self._cv.wait_for(lambda: not (self._loads or self._saves or self._busy))

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    def _put(self, queue: deque[Callable[[], None]], fn: Callable[[], None], limit: int | None) -> bool:
        with self._cv:
            if self._closed:
                raise RuntimeError("the kvpool connector's thread is closed")
            waited = limit is not None and len(queue) >= limit
            if limit is not None and waited:
                self._cv.wait_for(lambda: len(queue) < limit)
            queue.append(fn)
            self._cv.notify_all()
        return waited

    def _main(self) -> None:
        torch._C.set_num_threads(1)  # this thread only (vLLM replaces torch.set_num_threads with a no-op)
        while True:
            with self._cv:
                self._busy = False
                self._cv.notify_all()
                # (_busy here: a caller runs a job of its own, call(); the queued ones wait for it)
                self._cv.wait_for(lambda: (self._loads or self._saves or self._closed) and not self._busy)
                if not (self._loads or self._saves):
                    return  # closed, nothing left
                fn = (self._loads or self._saves).popleft()
                self._busy = True
                self._cv.notify_all()
            try:
                fn()
            except Exception:  # the jobs handle their own errors; this keeps the thread alive regardless
                logger.exception("kvpool connector: a job on its thread failed")
