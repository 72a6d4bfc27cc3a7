"""Stopping a child process, one way for every server, engine and tool the tests and the benchmarks start."""

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterable
from typing import IO, Any


def stop(
    proc: subprocess.Popen[Any],
    sig: int | None = signal.SIGTERM,
    timeout: float = 30,
    *,
    group: bool = False,
    close: Iterable[IO[Any] | None] = (),
) -> int:
    """Stop `proc` and reap it; its exit status.

    Its stdin, where it is a pipe, is closed first (a process driven over it leaves its loop at the end of its
    input). If it still runs, `sig` is sent (None: the closed stdin alone tells it), and after `timeout` s
    SIGKILL. group=True signals its process group instead (a process started with start_new_session=True:
    the children it started go with it). The files in `close` (its log, its other pipes) are closed last."""
    if proc.stdin is not None and not proc.stdin.closed:
        with contextlib.suppress(BrokenPipeError):  # it has already gone, with input unread
            proc.stdin.close()

    def send(signum: int) -> None:
        if group:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)

    if proc.poll() is None:
        if sig is not None:
            send(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            send(signal.SIGKILL)
            proc.wait()
    for file in close:
        if file is not None:
            file.close()
    return int(proc.returncode)
