"""benchmarks.processes.stop on real child processes: one that leaves at the end of its input, one that ignores
SIGTERM, and a process group whose child must go with its leader."""

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.processes import stop


def python(code: str, **popen: Any) -> "subprocess.Popen[bytes]":
    return subprocess.Popen([sys.executable, "-c", code], **popen)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, waiting for a parent to reap it, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_process_driven_over_stdin_leaves_when_it_is_closed(tmp_path: Path) -> None:
    log = (tmp_path / "log").open("wb")
    proc = python("import sys; sys.stdin.read(); sys.exit(3)", stdin=subprocess.PIPE, stdout=log)
    began = time.monotonic()
    assert stop(proc, None, timeout=30, close=[log]) == 3  # its own exit, not a signal's
    assert time.monotonic() - began < 20 and log.closed


def test_one_that_ignores_sigterm_is_killed_after_the_timeout() -> None:
    ready = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True)"
    proc = python(ready + "; time.sleep(60)", stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"1\n"  # its handler is set
    began = time.monotonic()
    assert stop(proc, timeout=0.5, close=[proc.stdout]) == -signal.SIGKILL
    assert 0.5 <= time.monotonic() - began < 20


def test_a_group_goes_whole_and_an_exited_process_is_only_reaped(tmp_path: Path) -> None:
    pid_file = tmp_path / "child"
    child = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])"
    proc = python(child + f"; open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)", start_new_session=True)
    deadline = time.monotonic() + 20
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    assert stop(proc, signal.SIGTERM, timeout=10, group=True) == -signal.SIGTERM
    deadline = time.monotonic() + 10
    while alive(grandchild) and time.monotonic() < deadline:  # the leader's child went too
        time.sleep(0.05)
    assert not alive(grandchild)
    done = python("pass")
    done.wait(30)
    assert stop(done) == 0  # nothing sent to a process that has exited
