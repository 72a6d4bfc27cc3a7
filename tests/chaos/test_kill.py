"""Kills, and a truncation attempt on the shared pool, against real `kvpool serve` processes (issue 13, findings
2 and 4).

Each server runs in a session of its own (start_new_session=True), as a container runtime or systemd starts it,
so that `os.killpg` reaches exactly its process group. Afterwards nothing named after its instance may remain in
/dev/shm. Figures are printed for docs/reliability.md (`pytest -s tests/chaos/test_kill.py`).
"""

import errno
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from service.client import KVPoolClient
from service.ipc.fd_socket import receive_fds
from tests.chaos.conn_helpers import report
from tests.conftest import SMALL_POOL, Server

SHM = Path("/dev/shm")
POSIX_SHM = {"KVPOOL_SHARED_MEMORY": "posix_shm"}


def start(env: dict[str, str] | None = None) -> tuple[Server, str]:
    server = Server({**SMALL_POOL, **(env or {})}, start_new_session=True)
    return server, server.client.get("/v1/ipc").json()["instance_id"]


def shm_files(instance_id: str) -> list[str]:
    return sorted(name for name in os.listdir(SHM) if instance_id[:16] in name)


def wait_gone(instance_id: str, timeout: float = 10) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := shm_files(instance_id)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def kill(server: Server, how: str) -> None:
    pid = server.proc.pid
    if how == "SIGTERM":
        assert server.stop(signal.SIGTERM) in (0, -signal.SIGTERM)
    elif how == "SIGKILL":
        server.stop(signal.SIGKILL)
    else:  # the whole process group, as `kill -9 -PGID`
        assert os.getpgid(pid) == pid
        os.killpg(pid, signal.SIGKILL)
        server.proc.wait(30)
        server.stop()
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)  # nothing of the group is left


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL", "killpg"])
def test_a_memfd_pool_leaves_nothing_in_dev_shm(how: str) -> None:
    server, instance = start()
    socket_path = Path(server.client.get("/v1/ipc").json()["socket"])
    with KVPoolClient(server.url) as client, client.attach() as pool:
        assert shm_files(instance) == []  # never a name: nothing to leave behind
        pool.blocks[0, 0, 0, 0, 0, 0] = 7.0
        kill(server, how)
        assert shm_files(instance) == []
        # The frontend's mapping outlives the server (the memory goes with the last mapping).
        assert pool.blocks[0, 0, 0, 0, 0, 0].item() == 7.0
    report(f"memfd pool, {how}", {"dev_shm_files_left": 0, "socket_file_left": socket_path.exists()})
    # A clean stop removes the socket file and its directory; a kill leaves an empty socket file in the
    # server's private directory (no memory), which the next server does not reuse.
    assert socket_path.exists() == (how != "SIGTERM")


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL", "killpg"])
def test_the_posix_shm_fallback_is_unlinked_however_the_server_dies(how: str) -> None:
    server, instance = start(POSIX_SHM)
    assert shm_files(instance) == [f"kvpool-{instance[:16]}-blocks"]
    kill(server, how)
    left = wait_gone(instance)
    report(f"posix_shm fallback, {how}", {"dev_shm_files_left": len(left)})
    assert left == []


def test_a_truncation_attempt_on_the_shared_pool_fails_and_the_server_keeps_serving() -> None:
    server, _ = start()
    try:
        _, fds = receive_fds(server.client.get("/v1/ipc").json()["socket"], None)
        (fd,) = fds
        size = os.fstat(fd).st_size
        outcomes = {}
        for name, target in (("shrink_to_4KiB", 4096), ("shrink_to_0", 0), ("grow_x2", size * 2)):
            try:
                os.ftruncate(fd, target)
                outcomes[name] = "succeeded"
            except OSError as exc:
                outcomes[name] = errno.errorcode[exc.errno]
        os.close(fd)
        report("truncation attempts on the memfd", outcomes)
        assert set(outcomes.values()) == {"EPERM"}
        with KVPoolClient(server.url) as client:
            client.create_sequence("s")
            k = torch.randn(2, 64, 2, 16)  # every page, the last one included
            assert client.append("s", 64, k=k, v=k).slots[-1] == 63
            assert client.attend(1, ["s"], torch.randn(1, 4, 16)).shape == (1, 4, 16)
        assert server.proc.poll() is None
    finally:
        server.stop()


def test_the_fallback_segment_can_be_truncated_which_is_why_memfd_is_the_default() -> None:
    """Finding 2 as it was, kept visible: the named segment can be shrunk by any process of the same user (the
    server's next write would die of SIGBUS, so the test restores the size before anything touches it)."""
    server, instance = start(POSIX_SHM)
    try:
        path = SHM / f"kvpool-{instance[:16]}-blocks"
        size = path.stat().st_size
        with open(path, "r+b") as f:
            os.ftruncate(f.fileno(), 4096)
            assert path.stat().st_size == 4096
            os.ftruncate(f.fileno(), size)  # (zeros now: the pool holds nothing yet)
        assert server.client.get("/healthz").status_code == 200
    finally:
        server.stop()


def test_the_next_server_removes_a_killed_servers_socket(tmp_path: Path) -> None:
    """A kill leaves the empty socket file; the next server started in the same place removes it (once it is a
    few seconds old: a socket being set up refuses connections for a moment too)."""
    env = {"KVPOOL_IPC_SOCKET_DIR": str(tmp_path)}
    first, _ = start(env)
    stale = Path(first.client.get("/v1/ipc").json()["socket"])
    kill(first, "SIGKILL")
    assert stale.is_socket()
    old = time.time() - 60
    os.utime(stale, (old, old), follow_symlinks=False)
    second, _ = start(env)
    try:
        live = Path(second.client.get("/v1/ipc").json()["socket"])
        assert not stale.parent.exists() and [p.name for p in tmp_path.iterdir()] == [live.parent.name]
    finally:
        second.stop()
    assert list(tmp_path.iterdir()) == []
