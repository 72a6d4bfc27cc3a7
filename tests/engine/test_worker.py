"""The engine's device worker: one thread, FIFO, errors reach the caller, the event loop stays free,
and device methods refuse to run anywhere else."""

import asyncio
import random
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from service.config import Settings
from service.engine.engine import DeviceEngine
from service.engine.storage import Storage


@pytest.fixture
def engine() -> Iterator[DeviceEngine]:
    settings = Settings(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, num_pages=8, device="cpu")
    storage = Storage(settings)
    engine = DeviceEngine(storage)
    yield engine
    engine.close()
    storage.close()


def test_jobs_run_in_submission_order_on_one_thread(engine: DeviceEngine) -> None:
    ran: list[tuple[int, threading.Thread]] = []
    rng = random.Random(0)

    def job(i: int) -> int:
        time.sleep(rng.random() / 500)  # uneven jobs: order must not depend on how long each takes
        ran.append((i, threading.current_thread()))
        return i * i

    async def main() -> list[int]:
        futures = [engine.submit(lambda i=i: job(i)) for i in range(50)]  # type: ignore[misc]
        return list(await asyncio.gather(*futures))

    assert asyncio.run(main()) == [i * i for i in range(50)]
    assert [i for i, _ in ran] == list(range(50))
    threads = {t for _, t in ran}
    assert len(threads) == 1 and threading.main_thread() not in threads


def test_a_failing_job_raises_in_its_caller_and_the_worker_goes_on(engine: DeviceEngine) -> None:
    error = ValueError("bad pages")

    def fail() -> None:
        raise error

    async def main() -> int:
        with pytest.raises(ValueError) as caught:
            await engine.submit(fail)
        assert caught.value is error
        return await engine.submit(lambda: 7)

    assert asyncio.run(main()) == 7
    with pytest.raises(ValueError):
        engine.call(fail)
    assert engine.call(lambda: 8) == 8


def test_the_event_loop_runs_while_a_job_runs(engine: DeviceEngine) -> None:
    async def main() -> int:
        job = engine.submit(lambda: time.sleep(0.5))
        ticks = 0
        while not job.done():
            await asyncio.sleep(0.01)
            ticks += 1
        await job
        return ticks

    assert asyncio.run(main()) >= 10  # ~50 expected; 0 or 1 if the job blocked the loop


def test_a_job_whose_caller_is_cancelled_still_runs(engine: DeviceEngine) -> None:
    gate, ran = threading.Event(), threading.Event()

    async def main() -> None:
        engine.submit(gate.wait)  # holds the worker so the next job is still queued when cancelled
        waiter = asyncio.ensure_future(engine.submit(ran.set))
        await asyncio.sleep(0)
        waiter.cancel()
        gate.set()
        await engine.submit(lambda: None)  # FIFO: once this is done, the cancelled caller's job ran

    asyncio.run(main())
    assert ran.is_set()


def test_device_methods_run_only_on_the_worker(engine: DeviceEngine) -> None:
    q = torch.zeros(1, 1, 8)
    lut, lengths, qsl = torch.zeros(1, 8, dtype=torch.int64), torch.tensor([0]), torch.tensor([0, 1])
    with pytest.raises(AssertionError, match="worker"):
        engine.attend(q, 0, lut, lengths, qsl)
    with pytest.raises(AssertionError, match="worker"):
        engine.copy_pages([(0, 1)])
    with pytest.raises(AssertionError, match="worker"):
        engine.write(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), torch.tensor([0]), 0)
    assert engine.call(lambda: engine.attend(q, 0, lut, lengths, qsl)).shape == (1, 1, 8)


def test_close_lets_queued_jobs_finish_then_refuses_more(engine: DeviceEngine) -> None:
    done: list[int] = []

    def job(i: int) -> None:
        time.sleep(0.05)
        done.append(i)

    async def main() -> None:
        for i in range(3):
            engine.submit(lambda i=i: job(i))  # type: ignore[misc]
        await asyncio.sleep(0)

    asyncio.run(main())
    engine.close()
    assert done == [0, 1, 2]
    with pytest.raises(RuntimeError):
        engine.call(lambda: None)

    async def after_close() -> None:
        for inline in (False, True):  # a small job too: nothing touches the pool after close
            with pytest.raises(RuntimeError):
                await engine.submit(lambda: done.append(99), inline=inline)

    asyncio.run(after_close())
    assert done == [0, 1, 2]
    engine.close()  # idempotent


def test_a_small_job_runs_inline_only_when_the_worker_is_idle(engine: DeviceEngine) -> None:
    """inline=True runs the job at once on the loop's thread if nothing is queued or running; otherwise
    it waits its turn on the worker, behind what was submitted before it (FIFO is kept)."""
    ran: list[tuple[str, threading.Thread]] = []
    release = threading.Event()

    def record(name: str) -> str:
        ran.append((name, threading.current_thread()))
        return name

    async def main() -> None:
        assert await engine.submit(lambda: record("idle"), inline=True) == "idle"
        slow = engine.submit(lambda: (release.wait(5), record("slow"))[1])
        behind = engine.submit(lambda: record("behind"), inline=True)  # the worker is busy: queued
        release.set()
        assert await slow == "slow" and await behind == "behind"
        assert await engine.submit(lambda: record("idle again"), inline=True) == "idle again"
        big = engine.submit(lambda: record("big"), inline=False)  # not small: the worker, even when idle
        assert await big == "big"

    asyncio.run(main())
    names = [name for name, _ in ran]
    assert names == ["idle", "slow", "behind", "idle again", "big"]
    threads = dict(ran)
    assert threads["idle"] is threads["idle again"] is threading.main_thread()
    assert threads["slow"] is threads["behind"] is threads["big"] is not threading.main_thread()


def test_an_inline_job_may_use_the_device_and_its_error_reaches_the_caller(engine: DeviceEngine) -> None:
    async def main() -> None:
        await engine.submit(lambda: engine.copy_pages([(0, 1)]), inline=True)  # device methods allowed inline
        with pytest.raises(ZeroDivisionError):
            await engine.submit(lambda: 1 // 0, inline=True)
        with pytest.raises(AssertionError):
            engine.copy_pages([(0, 1)])  # but not on the loop outside a job

    asyncio.run(main())


def test_fits_inline_bounds(engine: DeviceEngine) -> None:
    assert engine.fits_inline(DeviceEngine.INLINE_MAX_FLOPS, DeviceEngine.INLINE_MAX_BYTES)
    assert not engine.fits_inline(DeviceEngine.INLINE_MAX_FLOPS + 1)
    assert not engine.fits_inline(nbytes=DeviceEngine.INLINE_MAX_BYTES + 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_pool_on_plain_cuda_runs_jobs_on_the_worker_on_its_gpu() -> None:
    """KVPOOL_DEVICE=cuda (no index): the worker's initializer selects the GPU. Found on the first GPU
    run: torch.cuda.set_device refuses a device without an index, the pool broke its worker, and every
    job too large to run inline answered BrokenThreadPool."""
    storage = Storage(Settings(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, num_pages=8, device="cuda"))
    engine = DeviceEngine(storage)
    try:
        assert storage.device.index == torch.cuda.current_device()

        def job() -> tuple[int, bool]:
            storage.blocks.add_(1)
            return torch.cuda.current_device(), engine._on_worker()

        async def main() -> tuple[int, bool]:
            return await engine.submit(job)  # not inline: on the worker thread

        assert asyncio.run(main()) == (storage.device.index, True)
        assert bool((storage.blocks == 1).all())
    finally:
        engine.close()
        storage.close()
