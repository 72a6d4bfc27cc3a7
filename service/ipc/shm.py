"""POSIX shared-memory segments as torch tensors: created (and unlinked) by the server, mapped by clients.

The fallback where a sealed memfd is missing (service/ipc/memfd.py) or KVPOOL_SHARED_MEMORY=posix_shm: any
process of the same user can open a segment by name, and resize it.

The standard library's `multiprocessing.shared_memory.SharedMemory` is not used directly: its
`close()` fails while a tensor still views the mapping, and before Python 3.13 merely attaching
registers the segment with the attaching process's resource tracker, which then unlinks the
server's segment when that client exits. Here the mapping belongs to the tensor (torch.frombuffer
keeps the mmap alive until the last view is gone) and only the creator ever unlinks.

The creator registers its segments with a watchdog, a small process in a session of its own that unlinks
whatever is still registered when the creator dies, even by SIGKILL, and even when its whole process group is
killed (`kill -9 -PGID`, which also kills `multiprocessing`'s resource tracker, the mechanism used before).
Only a kill of every process of the container or cgroup (systemd's default KillMode) reaches the watchdog too.
"""

import _posixshmem  # the C module behind multiprocessing.shared_memory (POSIX only)
import math
import mmap
import os
import subprocess
import sys
import threading

import torch

# Reads "name" (watch) and "-name" (forget) lines until its stdin closes, which happens when the server exits
# however it dies (the kernel closes the pipe), then unlinks the names still watched.
WATCHDOG = """
import sys, _posixshmem
names = set()
for line in sys.stdin:
    name = line.strip()
    if name.startswith("-"):
        names.discard(name[1:])
    elif name:
        names.add(name)
for name in names:
    try:
        _posixshmem.shm_unlink("/" + name)
    except OSError:
        pass
"""
_watchdog: "subprocess.Popen[str] | None" = None
_watchdog_lock = threading.Lock()


def watchdog_pid() -> int | None:
    return None if _watchdog is None else _watchdog.pid


def _tell_watchdog(line: str) -> None:
    global _watchdog
    with _watchdog_lock:
        if _watchdog is None or _watchdog.poll() is not None:
            if line.startswith("-"):
                return
            _watchdog = subprocess.Popen(
                [sys.executable, "-c", WATCHDOG],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                text=True,
                start_new_session=True,  # out of reach of a kill of the server's process group
            )
        assert _watchdog.stdin is not None
        try:
            _watchdog.stdin.write(line + "\n")
            _watchdog.stdin.flush()
        except (BrokenPipeError, ValueError):  # it died (someone killed it): the server still unlinks on close
            pass


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def tensor_over(buffer: mmap.mmap, shape: tuple[int, ...], dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    # The tensor holds the mmap object (through the buffer protocol) for as long as any view lives.
    flat = torch.frombuffer(buffer, dtype=dtype, count=math.prod(shape), offset=offset)
    return flat.view(shape)


class Segment:
    """A named segment this process created; `unlink()` removes its name (idempotent)."""

    def __init__(self, name: str, nbytes: int) -> None:
        self.name = name
        self.nbytes = nbytes
        self.unlinked = False

    def unlink(self) -> None:
        if self.unlinked:
            return
        self.unlinked = True
        try:
            _posixshmem.shm_unlink("/" + self.name)
        except FileNotFoundError:
            pass
        try:
            _tell_watchdog("-" + self.name)
        except Exception:  # interpreter shutdown: nothing left to tell it
            pass


SHM_DIR = "/dev/shm"


def _no_room(nbytes: int, available: int | None, reason: str = "") -> RuntimeError:
    have = f" ({available / 2**30:.2f} GiB free)" if available is not None else ""
    return RuntimeError(
        f"the pool needs {nbytes / 2**30:.2f} GiB of shared memory but {SHM_DIR} cannot hold it{have}{reason}; "
        "make the pool smaller or /dev/shm larger (e.g. docker run --shm-size)"
    )


def _shm_available() -> int | None:
    if not os.path.isdir(SHM_DIR):
        return None
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def create_shared(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, Segment]:
    """A zero-filled tensor in a new segment `/dev/shm/<name>` (fails if the name exists)."""
    nbytes = max(math.prod(shape) * itemsize(dtype), 1)
    available = _shm_available()
    if available is not None and nbytes > available:
        raise _no_room(nbytes, available)
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    segment = Segment(name, nbytes)
    try:
        _tell_watchdog(name)
        os.ftruncate(fd, nbytes)  # new pages read as zeros: the null page starts (and stays) zero
        if hasattr(os, "posix_fallocate"):
            # Reserve the pages now: a tmpfs that runs out later answers a write with SIGBUS, not an error.
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                raise _no_room(nbytes, available, f": {exc.strerror}") from exc
        buffer = mmap.mmap(fd, nbytes)
    except BaseException:
        segment.unlink()
        raise
    finally:
        os.close(fd)
    return tensor_over(buffer, shape, dtype), segment


def open_shared(
    name: str, offset: int, nbytes: int, dtype: torch.dtype, shape: list[int], strides: list[int]
) -> torch.Tensor:
    """Map another process's segment: a tensor of `shape`/`strides` (in elements) at byte `offset`."""
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"shared-memory segment {name!r} does not exist: the server must run on this machine and share "
            "its /dev/shm (and still be running)"
        ) from None
    try:
        size = os.fstat(fd).st_size
        if size < offset + nbytes:
            raise ValueError(f"segment {name!r} has {size} bytes, the tensor needs {offset + nbytes}")
        buffer = mmap.mmap(fd, offset + nbytes)
    finally:
        os.close(fd)
    flat = tensor_over(buffer, (nbytes // itemsize(dtype),), dtype, offset)
    return flat.as_strided(shape, strides)
