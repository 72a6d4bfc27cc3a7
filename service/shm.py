"""POSIX shared-memory segments as torch tensors: created (and unlinked) by the server, mapped by clients.

The standard library's `multiprocessing.shared_memory.SharedMemory` is not used directly: its
`close()` fails while a tensor still views the mapping, and before Python 3.13 merely attaching
registers the segment with the attaching process's resource tracker, which then unlinks the
server's segment when that client exits. Here the mapping belongs to the tensor (torch.frombuffer
keeps the mmap alive until the last view is gone) and only the creator ever unlinks.

The creator does register its segment with `multiprocessing`'s resource tracker, a separate process
that unlinks whatever is still registered when the creator dies, even by SIGKILL.
"""

import _posixshmem  # the C module behind multiprocessing.shared_memory (POSIX only)
import math
import mmap
import os
import warnings
from multiprocessing import resource_tracker

import torch


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _tensor_over(buffer: mmap.mmap, shape: tuple[int, ...], dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    count = math.prod(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns about non-writable buffers only; ours are writable
        flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset)
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
            resource_tracker.unregister("/" + self.name, "shared_memory")
        except Exception:  # the tracker is gone (interpreter shutdown): nothing left to tell it
            pass


def create_shared(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, Segment]:
    """A zero-filled tensor in a new segment `/dev/shm/<name>` (fails if the name exists)."""
    nbytes = math.prod(shape) * _itemsize(dtype)
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    segment = Segment(name, nbytes)
    try:
        resource_tracker.register("/" + name, "shared_memory")
        os.ftruncate(fd, max(nbytes, 1))  # new pages read as zeros: the null page starts (and stays) zero
        buffer = mmap.mmap(fd, max(nbytes, 1))
    except BaseException:
        segment.unlink()
        raise
    finally:
        os.close(fd)
    return _tensor_over(buffer, shape, dtype), segment


def open_shared(
    name: str, offset: int, nbytes: int, dtype: torch.dtype, shape: list[int], strides: list[int]
) -> torch.Tensor:
    """Map another process's segment: a tensor of `shape`/`strides` (in elements) at byte `offset`."""
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0)
    try:
        size = os.fstat(fd).st_size
        if size < offset + nbytes:
            raise ValueError(f"segment {name!r} has {size} bytes, the tensor needs {offset + nbytes}")
        buffer = mmap.mmap(fd, offset + nbytes)
    finally:
        os.close(fd)
    flat = _tensor_over(buffer, (nbytes // _itemsize(dtype),), dtype, offset)
    return flat.as_strided(shape, strides)
