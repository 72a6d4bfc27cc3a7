"""The CPU pool in a sealed memfd (Linux): no name in /dev/shm, and a size nobody can change.

`memfd_create` makes an anonymous shared-memory file. Its size is fixed once and sealed
(F_SEAL_SHRINK | F_SEAL_GROW, then F_SEAL_SEAL so no further seal can be added or removed): a process
that receives the descriptor maps and writes the pages but gets EPERM from `ftruncate`, so it can no
longer shrink the file under the server's mapping (which made the server's next K/V write die with
SIGBUS). The memory is freed when the last descriptor and the last mapping are gone, however the
server died: there is nothing to unlink, and no resource tracker to outlive it.

Other processes get the descriptor over the server's Unix-domain socket (service/ipc/fd_socket.py);
there is no path to open.
"""

import fcntl
import math
import mmap
import os

import torch

from service.ipc.shm import itemsize, tensor_over

# Sealed in this order: the size seals first, then the seal that forbids changing the seals.
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW if hasattr(fcntl, "F_SEAL_SHRINK") else 0


def memfd_available() -> bool:
    """Whether this system can create a sealed memfd (Linux >= 3.17; not macOS, not every sandbox)."""
    if not (hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")):
        return False
    try:
        fd = os.memfd_create("kvpool-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS | fcntl.F_SEAL_SEAL)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _memory_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _no_memory(nbytes: int, available: int | None, reason: str = "") -> RuntimeError:
    have = f" ({available / 2**30:.2f} GiB available)" if available is not None else ""
    return RuntimeError(
        f"the pool needs {nbytes / 2**30:.2f} GiB of shared memory but the machine cannot hold it{have}{reason}; "
        "make the pool smaller"
    )


class SealedFile:
    """A memfd this process created and sealed; `close()` drops the descriptor (idempotent)."""

    def __init__(self, fd: int, name: str, nbytes: int) -> None:
        self.fd = fd
        self.name = name
        self.nbytes = nbytes

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def create_sealed(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, SealedFile]:
    """A zero-filled tensor in a new memfd of exactly its size, sealed against shrinking and growing."""
    nbytes = max(math.prod(shape) * itemsize(dtype), 1)
    available = _memory_available()
    if available is not None and nbytes > available:
        raise _no_memory(nbytes, available)
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)  # new pages read as zeros: the null page starts (and stays) zero
        try:
            # Reserve the pages now: memory that runs out later answers a write with SIGBUS, not an error.
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            raise _no_memory(nbytes, available, f": {exc.strerror}") from exc
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)
        buffer = mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return tensor_over(buffer, shape, dtype), SealedFile(fd, name, nbytes)


def map_sealed(
    fd: int, offset: int, nbytes: int, dtype: torch.dtype, shape: list[int], strides: list[int]
) -> torch.Tensor:
    """Map a received memfd: a tensor of `shape`/`strides` (in elements) at byte `offset`.

    Refuses a file whose size is not sealed (it could shrink under the mapping). The caller still owns `fd`
    and may close it once mapped: the mapping keeps the memory.
    """
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & SIZE_SEALS != SIZE_SEALS:
        raise ValueError("the pool's descriptor is not sealed against resizing: refusing to map it")
    size = os.fstat(fd).st_size
    if size < offset + nbytes:
        raise ValueError(f"the pool's memfd has {size} bytes, the tensor needs {offset + nbytes}")
    buffer = mmap.mmap(fd, offset + nbytes)
    flat = tensor_over(buffer, (nbytes // itemsize(dtype),), dtype, offset)
    return flat.as_strided(shape, strides)
