"""KV block layouts learned from the attention backend's own writer: vLLM's CPU AMX blocks, FP8 caches, MLA.

Some backends lay a block out in ways no fixed view reads: vLLM's CPU attention on an AMX machine packs a
bf16 block in tiles (K as 16 tokens x 2 channels, V as 2 tokens per channel), an FP8 cache holds bytes,
and its MLA backends keep one latent per token ([num_blocks, 1, block_size, kv_lora_rank + rope] on the CPU).
`learn_block_map` does not guess: it writes probes through the layer's own `do_kv_cache_update` into a
two-block scratch cache and reads back where each (component, token, head, channel) of a block went:

- calibration: one probe per symbol (16 powers of two, exact in every float and FP8 format), all of a
  block's elements alike, gives the stored bits of each symbol (this covers vLLM's FP8 conversion and its
  k_scale/v_scale, whatever they are), and proves the writer keeps to its block;
- then four probes write the digits (base 16) of each element's index: every position of the block must
  hold exactly one element (a permutation), else the layout is refused.

A block is then a fixed permutation of its token-major elements, and the copies below gather and scatter
the stored bits through it (K/V bytes move as they are: an FP8 cache is never re-quantized).
kvpool's pool holds the same bits in its own page layout, [num_pages + 1, C, L, page_size, H, D] with C = 2
(K, V) or 1 (an MLA latent; H = 1). An FP8 pool's per-group scales are written with vLLM's per-layer
k_scale / v_scale on save (a special case of kvpool's format: value = fp8 * scale), and a load checks them:
a page quantized some other way is not loaded (the load fails and vLLM recomputes).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from service.integrations.vllm_layout import scratch_like

# The probes' symbols: exact in float32/16, bfloat16, e4m3 and e5m2, also after a power-of-two scale.
SYMBOLS = [sign * 2.0**e for sign in (1.0, -1.0) for e in range(-4, 4)]
BASE = len(SYMBOLS)

# (values [C, T, H, D] in the model's dtype, cache, slots [T]) -> None: the backend's writer for one layer.
ProbeWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def raw_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as signed integers of its element size (a view)."""
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


@dataclass(frozen=True)
class BlockMap:
    """where[c, t, i]: the element of a block's memory holding component c, token t, channel i of H * D."""

    where: torch.Tensor  # int64 [C, block_size, H * D]

    @property
    def components(self) -> int:
        return int(self.where.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.where.shape[1])

    @property
    def block_numel(self) -> int:
        return int(self.where.numel())


class UnknownLayout(ValueError):
    pass


def learn_block_map(write: ProbeWriter, cache: torch.Tensor, components: int, heads: int, head_dim: int,
                    dtype: torch.dtype) -> BlockMap:  # fmt: skip
    """The permutation `write` stores a block of `cache` in; UnknownLayout when it is none."""
    if cache.device.type != "cpu" or not cache.is_contiguous():
        raise UnknownLayout("learned block layouts are for contiguous CPU caches")
    block_size = cache.numel() // cache.shape[0] // (components * heads * head_dim)
    numel = components * block_size * heads * head_dim
    if cache[0].numel() != numel:
        raise UnknownLayout(
            f"a block holds {cache[0].numel()} elements, not {components} x tokens x {heads} x {head_dim}"
        )
    scratch = scratch_like(cache, 2)
    bits = raw_bits(scratch).reshape(2, numel)
    slots = torch.arange(block_size, 2 * block_size)  # block 1, every offset
    symbols = torch.tensor(SYMBOLS)

    def probe(digits: torch.Tensor) -> torch.Tensor:
        """Write symbols[digits] ([C, T, H, D]) to block 1; its bits, flat."""
        scratch.zero_()
        write(symbols[digits].to(dtype), scratch, slots)
        if bool(bits[0].any()):
            raise UnknownLayout("the writer wrote outside the slots' block")
        return bits[1].clone()

    shape = (components, block_size, heads, head_dim)
    codes = []
    for i in range(BASE):
        stored = probe(torch.full(shape, i))
        if not bool((stored == stored[0]).all()):
            raise UnknownLayout("a block of one value is not stored as one value")
        codes.append(int(stored[0]))
    if len(set(codes)) != BASE:
        raise UnknownLayout("distinct values are stored alike")
    index = torch.arange(numel).view(shape)
    at = torch.zeros(numel, dtype=torch.int64)  # the element index held at each position
    for p in range((numel - 1).bit_length() // 4 + 1):
        stored = probe(index // BASE**p % BASE)
        digit = torch.full((numel,), -1, dtype=torch.int64)
        for i, code in enumerate(codes):
            digit[stored == code] = i
        if bool((digit < 0).any()):
            raise UnknownLayout("the writer stored a value that no symbol stores as")
        at += digit * BASE**p
    if not torch.equal(torch.sort(at).values, torch.arange(numel)):
        raise UnknownLayout("a block is not a permutation of its tokens' elements")
    where = torch.empty(numel, dtype=torch.int64)
    where[at] = torch.arange(numel)
    return BlockMap(where.view(components, block_size, heads * head_dim))


@dataclass
class LearnedPlan:
    """Tokens [start, end) of a sequence: the blocks holding them (first to last), the token index within
    those blocks, and the page and offset of each token in kvpool."""

    blocks: torch.Tensor
    local: torch.Tensor
    pages: torch.Tensor
    offsets: torch.Tensor
    cache_positions: torch.Tensor  # int64 [C, T, H * D]: each element's index in the flat cache


def learned_plan(bmap: BlockMap, block_ids: list[int], pages: list[int], page_size: int, start: int,
                 end: int) -> LearnedPlan:  # fmt: skip
    size = bmap.block_size
    first, last = start // size, -(-end // size)
    tokens = torch.arange(start, end)
    blocks = torch.tensor(block_ids[first:last], dtype=torch.int64)
    page_ids = torch.tensor(pages, dtype=torch.int64)[tokens // page_size]
    base = torch.tensor(block_ids, dtype=torch.int64)[tokens // size] * bmap.block_numel  # [T]
    positions = base[None, :, None] + bmap.where[:, tokens % size]  # [C, T, H * D]
    return LearnedPlan(blocks, tokens - first * size, page_ids, tokens % page_size, positions)


def save_learned(bmap: BlockMap, cache: torch.Tensor, pool_layer: torch.Tensor, plan: LearnedPlan) -> None:
    """One layer's tokens from vLLM's `cache` into the pool (pool_layer: [P + 1, C, page, H, D], same bits)."""
    c, size = bmap.components, bmap.block_size
    blocks = raw_bits(cache).reshape(cache.shape[0], -1)[plan.blocks]  # [n, E]
    tokens = blocks[:, bmap.where.view(-1)].view(len(plan.blocks), c, size, -1)  # [n, C, block, H * D]
    tokens = tokens.transpose(0, 1).reshape(c, -1, tokens.shape[-1])[:, plan.local]  # [C, T, H * D]
    dst = raw_bits(pool_layer).flatten(-2)  # [P + 1, C, page, H * D]
    for i in range(c):
        dst[:, i].index_put_((plan.pages, plan.offsets), tokens[i])


def load_learned(cache: torch.Tensor, pool_layer: torch.Tensor, plan: LearnedPlan) -> None:
    """One layer's tokens from the pool into vLLM's `cache` (bits as they are)."""
    src = raw_bits(pool_layer).flatten(-2)  # [P + 1, C, page, H * D]
    values = src[plan.pages, :, plan.offsets].transpose(0, 1)  # [C, T, H * D]
    raw_bits(cache).view(-1)[plan.cache_positions] = values


def scales_match(scales_layer: torch.Tensor, plan: LearnedPlan, kv_scales: tuple[float, ...]) -> bool:
    """An FP8 pool's scales of the plan's tokens (scales_layer: [P + 1, 2, page, H, D // g]) are vLLM's."""
    held = scales_layer[plan.pages, :, plan.offsets].float()  # [T, 2, H, D // g]
    return all(bool((held[:, i] == scale).all()) for i, scale in enumerate(kv_scales))


def save_scales(scales_layer: torch.Tensor, plan: LearnedPlan, kv_scales: tuple[float, ...]) -> None:
    for i, scale in enumerate(kv_scales):
        scales_layer[:, i].index_put_((plan.pages, plan.offsets), torch.tensor(scale, dtype=scales_layer.dtype))


class LearnedCopier:
    """Loads and saves for a worker whose layers' blocks all follow one learned BlockMap. `kv_scales`: FP8
    caches, each layer's (k_scale, v_scale), which the pool's scales of its tokens hold."""

    def __init__(self, caches: dict[int, torch.Tensor], bmap: BlockMap,
                 kv_scales: dict[int, tuple[float, float]] | None = None) -> None:  # fmt: skip
        self.caches, self.bmap, self.kv_scales = caches, bmap, kv_scales
        self.device = torch.device("cpu")

    def load(self, pool: torch.Tensor, scales: torch.Tensor | None, pages: list[int], block_ids: list[int],
             start: int, end: int) -> bool:  # fmt: skip
        """Tokens [start, end) from the pool (pool.blocks, [P + 1, C, L, page, H, D]) into vLLM's blocks; False
        (nothing copied) when an FP8 page's scales are not vLLM's."""
        plan = learned_plan(self.bmap, block_ids, pages, pool.shape[3], start, end)
        if self.kv_scales is not None:
            if scales is None:
                return False
            if not all(scales_match(scales[:, :, i], plan, s) for i, s in self.kv_scales.items()):
                return False
        for layer, cache in self.caches.items():
            load_learned(cache, pool[:, :, layer], plan)
        return True

    def save(self, pool: torch.Tensor, scales: torch.Tensor | None, block_ids: list[int], pages: list[int],
             start: int, end: int) -> None:  # fmt: skip
        plan = learned_plan(self.bmap, block_ids, pages, pool.shape[3], start, end)
        for layer, cache in self.caches.items():
            save_learned(self.bmap, cache, pool[:, :, layer], plan)
        if self.kv_scales is not None:
            assert scales is not None, "an FP8 cache saved into a pool without scales"
            for layer, kv in self.kv_scales.items():
                save_scales(scales[:, :, layer], plan, kv)
