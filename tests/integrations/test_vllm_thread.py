"""The vLLM connector's thread: a worker's loads waited for and ahead of queued saves (a scheduler's calls in
order with its releases), saves bounded, drained and run before the thread stops."""

import threading
import time

import pytest

from service.integrations.vllm_thread import ConnectorThread


@pytest.mark.parametrize("ordered", [False, True], ids=["worker", "scheduler"])
def test_loads_run_before_queued_saves_unless_ordered_and_saves_keep_their_order(ordered: bool) -> None:
    """A worker's loads go ahead of its queued saves (the forward waits for them); the scheduler's waited-for
    calls queue behind the releases submitted before them (`ordered`: kvpool gets them in order)."""
    thread = ConnectorThread(max_saves=8, ordered=ordered)
    order: list[str] = []
    gate, started = threading.Event(), threading.Event()
    thread.submit(lambda: (started.set(), gate.wait()))  # occupies the thread
    started.wait()
    for i in range(3):
        thread.submit(lambda i=i: order.append(f"save{i}"))
    loaded = threading.Thread(target=lambda: thread.run(lambda: order.append("load")))
    loaded.start()
    while len(thread._loads) + len(thread._saves) < 4:  # the load queued behind the running save
        time.sleep(0.001)
    gate.set()
    loaded.join()
    thread.drain()
    saves = ["save0", "save1", "save2"]
    assert order == ([*saves, "load"] if ordered else ["load", *saves])
    thread.close()


def test_run_returns_the_result_and_raises_what_the_job_raised() -> None:
    thread = ConnectorThread(max_saves=1)
    assert thread.run(lambda: threading.current_thread().name) == "kvpool-connector"
    with pytest.raises(ZeroDivisionError):
        thread.run(lambda: 1 // 0)
    assert thread.run(lambda: 7) == 7  # the thread lives on
    thread.close()


def test_a_full_save_queue_makes_the_caller_wait_and_close_runs_what_is_queued() -> None:
    thread = ConnectorThread(max_saves=2)
    gate, started = threading.Event(), threading.Event()
    done: list[int] = []
    assert thread.submit(lambda: (started.set(), gate.wait())) is False
    started.wait()  # running, no longer queued
    assert thread.submit(lambda: done.append(1)) is False
    assert thread.submit(lambda: done.append(2)) is False
    waited: list[bool] = []
    third = threading.Thread(target=lambda: waited.append(thread.submit(lambda: done.append(3))))
    third.start()
    third.join(0.2)
    assert third.is_alive() and not waited  # two queued: the third submit waits for room
    gate.set()
    third.join()
    assert waited == [True]
    thread.close()  # runs the queued saves first
    assert done == [1, 2, 3]
    with pytest.raises(RuntimeError, match="closed"):
        thread.submit(lambda: None)


def test_call_runs_on_the_callers_thread_when_idle_and_holds_queued_jobs_back_meanwhile() -> None:
    thread = ConnectorThread(max_saves=4)
    here = threading.current_thread().name
    assert thread.call(lambda: threading.current_thread().name) == here
    order: list[str] = []
    inside, leave = threading.Event(), threading.Event()

    def own_job() -> str:
        inside.set()
        leave.wait()
        order.append("call")
        return threading.current_thread().name

    caller = threading.Thread(target=lambda: order.append(thread.call(own_job)), name="scheduler")
    caller.start()
    inside.wait()
    thread.submit(lambda: order.append("save"))  # queued while the caller uses the link: waits for it
    time.sleep(0.05)
    assert order == []
    leave.set()
    caller.join()
    thread.drain()
    assert order == ["call", "scheduler", "save"]
    # Busy: a call goes to the thread, after the job running there.
    gate, started = threading.Event(), threading.Event()
    thread.submit(lambda: (started.set(), gate.wait()))
    started.wait()
    answer: list[str] = []
    waiting = threading.Thread(target=lambda: answer.append(thread.call(lambda: threading.current_thread().name)))
    waiting.start()
    waiting.join(0.1)
    assert waiting.is_alive()
    gate.set()
    waiting.join()
    assert answer == ["kvpool-connector"]
    with pytest.raises(ZeroDivisionError):
        thread.call(lambda: 1 // 0)
    assert thread.call(lambda: 5) == 5  # the thread idle again after a job that raised
    thread.close()
