"""K/V copies between vLLM's KV blocks and kvpool's mapped pool, whole pages and blocks at a time.

`KVCopier` does both directions for a worker: with the compiled copy (_vllm_copy.c, built by setup.py)
two passes (the V, then the K) over every layer per call, runs of g = gcd(page_size, block_size) tokens,
streaming stores where whole lines are written, without the GIL
(a save on the connector's thread leaves vLLM's Python running); else with the torch ops below. The
compiled copy has wide builds (AVX-512, else AVX2: K transposed 16 x 16 in registers; float32 pools with
head_dim and block size multiples of 16, or AVX2 for 2-byte pools with multiples of 32; g a multiple of
16; 64-byte aligned buffers), taken where the CPU and the shapes allow,
and a narrow one (SSE2 and scalar) for everything else; `widest` caps the build (tests run each).

kvpool's pool is page-major, [num_pages + 1, 2, num_layers, page_size, kv_heads, head_dim]: one layer's K
(or V) of a page is a contiguous [page_size, H, D], token-major. One layer's vLLM CPU block is
[H, block_size, 2 * head_dim]: K stored transposed ([head_dim, block_size] per head), V as is; a GPU
backend's is [H, block_size, 2 * head_dim] with K then V per token, in vLLM's stride order (vllm_layout).
The compiled copy knows the CPU layout only: every other layout, and caches or a pool on a GPU, take the
torch path (which reads through vllm_layout.kv_views, and loads through the backend's own writer).

- Load (pool -> vLLM), per layer: one index_select gathers the pages holding the tokens into a reused
  buffer (each page a contiguous run), which is then token-major [tokens, H, D]; the attention backend's
  own cache writer (`do_kv_cache_update`, the kernel vLLM stores every computed token with, transposing
  K as it goes) puts them at their slots.
- Save (vLLM -> pool), per layer: the blocks holding the tokens are sliced (consecutive ids) or gathered
  by one index_select into a reused buffer; then each run of g = gcd(page_size, block_size) tokens goes
  to its page: one index_put per offset of a run within a block (block_size / g of them), whose strided
  read undoes K's transpose.

Buffers are kept between calls (a fresh tensor of megabytes pays its page faults at every copy), one
`Buffers` per thread. Index tensors are built once per request (a plan), not per layer.
"""

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from service.integrations.vllm_layout import Layout, kv_views


def _native() -> ModuleType | None:
    try:
        return importlib.import_module("service.integrations._vllm_copy")
    except ImportError:  # not built (a source checkout without `pip install -e .`)
        return None


NATIVE = _native()

# The backend's writer for one layer: (key [T, H, D], value [T, H, D], slots [T]) -> None.
Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


class Buffers:
    """Reused scratch tensors, by name (one instance per thread)."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._bufs[name] = buf
        return buf[:numel].view(shape)


@dataclass
class LoadPlan:
    """Tokens [start, end): the pages holding them (ids), and the vLLM slot of each token."""

    pages: torch.Tensor
    offset: int  # token `start` within the first page
    count: int
    slots: torch.Tensor


def load_plan(
    pages: list[int], page_size: int, block_ids: list[int], block_size: int, start: int, end: int
) -> LoadPlan:
    """pages / block_ids: the sequence's pages and blocks, from its token 0."""
    first, last = start // page_size, -(-end // page_size)
    tokens = torch.arange(start, end)
    slots = torch.tensor(block_ids, dtype=torch.int64)[tokens // block_size] * block_size + tokens % block_size
    return LoadPlan(torch.tensor(pages[first:last], dtype=torch.int64), start - first * page_size, end - start, slots)


def load_on_devices(plan: LoadPlan, pool: torch.device, cache: torch.device) -> LoadPlan:
    """The plan's indices where they are used: page ids with the pool, slots with the cache (once per request)."""
    return LoadPlan(plan.pages.to(pool), plan.offset, plan.count, plan.slots.to(cache))


def load_layer(write: Writer, pool_layer: torch.Tensor, plan: LoadPlan, bufs: Buffers) -> None:
    """Copy the plan's tokens of one layer from the pool (pool.blocks[:, :, layer], [P + 1, 2, page, H, D])."""
    page_size, heads, head_dim = pool_layer.shape[2:]
    kv = []
    for i, name in enumerate(("load_k", "load_v")):
        buf = bufs.get(name, (len(plan.pages), page_size, heads, head_dim), pool_layer)
        torch.index_select(pool_layer[:, i], 0, plan.pages, out=buf)
        kv.append(buf.view(-1, heads, head_dim)[plan.offset : plan.offset + plan.count])
    # A pool on another device than the cache (a CPU kvpool beside vLLM on a GPU): the writer takes K/V there.
    device = plan.slots.device
    write(kv[0].to(device), kv[1].to(device), plan.slots)


@dataclass
class SaveRun:
    """The runs at offset j * g of the local blocks [lo, hi): their pages, and the run index in each page."""

    j: int
    lo: int
    hi: int
    pages: torch.Tensor
    runs: torch.Tensor


@dataclass
class SavePlan:
    blocks: list[int]  # the blocks holding the tokens, in token order
    block_index: torch.Tensor  # the same, as the gather's index (on the cache's device)
    first_block: int | None  # blocks[0] when the ids are consecutive (then sliced, not gathered)
    g: int
    runs: list[SaveRun]


def save_plan(
    block_ids: list[int], block_size: int, pages: list[int], page_size: int, start: int, end: int
) -> SavePlan:
    """Tokens [start, end) of a sequence (block_ids / pages from its token 0); start and end multiples of
    g = gcd(block_size, page_size) (true of whole pages, which is all the connector saves)."""
    g = math.gcd(block_size, page_size)
    if start % g or end % g:
        raise ValueError(f"tokens [{start}, {end}) are not runs of {g}")
    b_first, b_last = start // block_size, -(-end // block_size)
    blocks = block_ids[b_first:b_last]
    consecutive = blocks == list(range(blocks[0], blocks[0] + len(blocks))) if blocks else True
    pages_t = torch.tensor(pages, dtype=torch.int64)
    runs = []
    for j in range(block_size // g):
        offset = b_first * block_size + j * g  # token of run j of local block 0
        lo = max(0, -(-(start - offset) // block_size))
        hi = (end - g - offset) // block_size + 1  # local blocks i whose run ends by `end`
        if hi > lo:
            tokens = offset + torch.arange(lo, hi) * block_size
            runs.append(SaveRun(j, lo, hi, pages_t[tokens // page_size], tokens % page_size // g))
    first_block = blocks[0] if consecutive and blocks else None
    return SavePlan(blocks, torch.tensor(blocks, dtype=torch.int64), first_block, g, runs)


def save_on_devices(plan: SavePlan, pool: torch.device, cache: torch.device) -> SavePlan:
    """The plan's indices where they are used: block ids with the cache, pages and runs with the pool."""
    runs = [SaveRun(r.j, r.lo, r.hi, r.pages.to(pool), r.runs.to(pool)) for r in plan.runs]
    return SavePlan(plan.blocks, plan.block_index.to(cache), plan.first_block, plan.g, runs)


def save_layer(
    cache: torch.Tensor, pool_layer: torch.Tensor, plan: SavePlan, bufs: Buffers, layout: Layout = Layout.CPU_VEC
) -> None:
    """Copy the plan's tokens of one layer from vLLM's `cache` [blocks, H, block, 2D] (in `layout`) into the
    pool."""
    if not plan.blocks:
        return
    if plan.first_block is not None:
        src = cache[plan.first_block : plan.first_block + len(plan.blocks)]
    else:
        # Gathered contiguous in the logical order: still the same layout (CPU_VEC caches are contiguous).
        src = bufs.get("save_blocks", (len(plan.blocks), *cache.shape[1:]), cache)
        torch.index_select(cache, 0, plan.block_index, out=src)
    block_size, page_size, g = cache.shape[2], pool_layer.shape[2], plan.g
    dst = pool_layer.unflatten(2, (page_size // g, g))  # [P + 1, 2, runs per page, g, H, D]
    for i, view in enumerate(kv_views(src, layout)):  # [n, H, block, D]
        runs = view.unflatten(2, (block_size // g, g))  # [n, H, runs per block, g, D]
        for run in plan.runs:
            values = runs[run.lo : run.hi, :, run.j].transpose(1, 2)  # [hi - lo, g, H, D]
            dst[:, i].index_put_((run.pages, run.runs), values.to(pool_layer.device))


def run_table(block_ids: list[int], block_size: int, pages: list[int], page_size: int, start: int, end: int) -> Any:
    """int64 [n, 4]: (block, offset, page, offset) of each run of g = gcd(block_size, page_size) tokens in
    [start, end) of a sequence (block_ids / pages from its token 0), as a numpy array (numpy, not torch: a
    third of the time, ~12 us for 126 runs, inside each load's and save's timed copy)."""
    g = math.gcd(block_size, page_size)
    if start % g or end % g:
        raise ValueError(f"tokens [{start}, {end}) are not runs of {g}")
    tokens = np.arange(start, end, g, dtype=np.int64)
    table = np.empty((len(tokens), 4), dtype=np.int64)
    table[:, 0] = np.asarray(block_ids, dtype=np.int64)[tokens // block_size]
    table[:, 1] = tokens % block_size
    table[:, 2] = np.asarray(pages, dtype=np.int64)[tokens // page_size]
    table[:, 3] = tokens % page_size
    return table


def raw(tensor: torch.Tensor) -> Any:
    """The tensor's memory as a numpy array of same-size integers (numpy has no bfloat16; a copy is bits)."""
    return tensor.view({4: torch.int32, 2: torch.int16}[tensor.element_size()]).numpy()


class KVCopier:
    """Loads and saves of whole runs for one worker: caches[layer] is vLLM's cache of that layer (in `layout`,
    as vllm_layout.check_layout found it), writers[layer] its attention backend's cache writer (the torch path's
    loads store with it).

    On a GPU, load() and save() return once their copies are done on the device: a load before vLLM's forward
    reads the blocks (and it starts once vLLM's earlier work is done), a save before kvpool commits the pages or
    vLLM reuses the blocks.
    """

    def __init__(
        self,
        caches: dict[int, torch.Tensor],
        writers: dict[int, Writer],
        block_size: int,
        native: bool = True,
        widest: str = "avx512",
        layout: Layout = Layout.CPU_VEC,
    ) -> None:
        self.caches, self.writers, self.block_size, self._widest = caches, writers, block_size, widest
        self.layout = layout
        self.build = ""  # the compiled build of the last copy: "avx512", "avx2" or "narrow" ("": none yet)
        layers = [caches[i] for i in range(len(caches))]
        self.device = layers[0].device if layers else torch.device("cpu")
        # The compiled copy reads and writes the CPU layout's memory directly: CPU caches in that layout only.
        use = (
            native
            and NATIVE is not None
            and layout is Layout.CPU_VEC
            and all(c.device.type == "cpu" and c.element_size() in (2, 4) for c in layers)
        )
        self._raw = [raw(c) for c in layers] if use else None
        self._load_bufs, self._save_bufs = Buffers(), Buffers()  # one each: loads and saves may run on two threads

    @property
    def native(self) -> bool:
        return self._raw is not None

    def load(self, pool: torch.Tensor, pages: list[int], block_ids: list[int], start: int, end: int) -> None:
        """Tokens [start, end) from the pool (pool.blocks, [P + 1, 2, L, page_size, H, D]) into vLLM's blocks."""
        if self._raw is not None:
            self._copy_native(pool, block_ids, pages, start, end, to_pool=False)
            return
        plan = load_plan(pages, pool.shape[3], block_ids, self.block_size, start, end)
        plan = load_on_devices(plan, pool.device, self.device)
        # vLLM's queued work on these blocks (its zeroing of new blocks, a freed request's last reads) is done.
        self._wait(pool, vllms_work=True)
        for layer, write in self.writers.items():
            load_layer(write, pool[:, :, layer], plan, self._load_bufs)
        self._wait(pool)  # the blocks are written before vLLM's forward, on its own stream, reads them

    def save(self, pool: torch.Tensor, block_ids: list[int], pages: list[int], start: int, end: int) -> None:
        """Tokens [start, end) from vLLM's blocks into the pool's pages."""
        if self._raw is not None:
            self._copy_native(pool, block_ids, pages, start, end, to_pool=True)
            return
        plan = save_on_devices(
            save_plan(block_ids, self.block_size, pages, pool.shape[3], start, end), pool.device, self.device
        )
        for layer, cache in self.caches.items():
            save_layer(cache, pool[:, :, layer], plan, self._save_bufs, self.layout)
        # The pages hold the K/V before kvpool commits them (other processes read the pool) and before vLLM,
        # told the save is done, reuses the blocks. (That the forward has written the blocks before this save
        # reads them is the caller's: the connector waits for an event recorded after the forward.)
        self._wait(pool)

    def _wait(self, pool: torch.Tensor, vllms_work: bool = False) -> None:
        """On the GPU(s) of the caches and the pool, wait for this thread's copies (its current stream), or for
        all work (vLLM's streams too; not at the end of a save: vLLM's next forward may be queued by then)."""
        for device in {self.device, pool.device}:
            if device.type == "cuda":
                if vllms_work:
                    torch.cuda.synchronize(device)
                else:
                    torch.cuda.current_stream(device).synchronize()

    def _copy_native(
        self, pool: torch.Tensor, block_ids: list[int], pages: list[int], start: int, end: int, to_pool: bool
    ) -> None:
        """Either direction through the compiled copy (self._raw is set only where NATIVE is built)."""
        assert NATIVE is not None and self._raw is not None
        runs = run_table(block_ids, self.block_size, pages, pool.shape[3], start, end)
        g = math.gcd(self.block_size, pool.shape[3])
        self.build = NATIVE.copy(raw(pool), self._raw, runs, g, to_pool, self._widest)
