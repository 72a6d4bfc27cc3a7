"""The vLLM connector's GPU block layout on device caches (vLLM itself does not travel to the GPU machine).

Caches strided as vLLM 0.32 allocates them by default (KVCacheLayout LBNHC: one buffer [L, B, N, H, 2D]
in memory, each layer's logical view [B, H, N, 2D]; vllm/v1/kv_cache_interface.py), written by the
torch form of its GPU backends' `do_kv_cache_update` (key_cache, value_cache = kv_cache.transpose(1, 2)
.split(D, -1); token i at [slot // N, slot % N]), on a stream of their own as vLLM's forward would. The
save waits for an event recorded after that "forward", as the connector's worker does
(vllm_worker.wait_for_save); the load must be complete before the next forward reads. Both exact.
"""

from functools import partial

import torch

from benchmarks.gpu.report import Report
from service.integrations.vllm_copy import KVCopier, Writer
from service.integrations.vllm_layout import Layout

PART = "service"


def lbnhc_caches(layers: int, blocks: int, heads: int, block: int, d: int, device: torch.device) -> list[torch.Tensor]:
    physical = torch.randn(layers, blocks, block, heads, 2 * d, device=device)  # [L, B, N, H, C] in memory
    return list(physical.permute(0, 1, 3, 2, 4).unbind(0))  # each [B, H, N, C]


def do_kv_cache_update(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    key_cache, value_cache = cache.transpose(1, 2).split(key.shape[-1], dim=-1)  # [B, N, H, D] each
    block = key_cache.shape[1]
    key_cache[slots // block, slots % block] = key
    value_cache[slots // block, slots % block] = value


def layout_checks(report: Report, device: torch.device) -> None:
    layers, num_blocks, heads, block, d, page = 4, 64, 8, 16, 128, 16
    tokens = 40 * block + 5 if not report.dry_run else 3 * block + 5
    end = tokens - tokens % page  # whole pages only are saved
    caches = lbnhc_caches(layers, num_blocks, heads, block, d, device)
    block_ids = torch.randperm(num_blocks)[: -(-tokens // block)].tolist()
    pages = (torch.randperm(num_blocks) + 1)[: -(-tokens // page)].tolist()
    pool = torch.randn(num_blocks + 2, 2, layers, page, heads, d, device=device)  # poison; the null page last
    forward = torch.cuda.Stream(device) if device.type == "cuda" else None
    pos = torch.arange(tokens, device=device)
    slots = torch.tensor(block_ids, device=device)[pos // block] * block + pos % block
    k = torch.randn(layers, tokens, heads, d, device=device)
    v = torch.randn(layers, tokens, heads, d, device=device)
    with torch.cuda.stream(forward) if forward is not None else _nothing():
        if forward is not None:  # the "forward" is still running when the save is queued: ~30 ms of matmuls
            busy = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
            product = torch.empty_like(busy)
            for _ in range(200):
                torch.mm(busy, busy, out=product)
        for layer in range(layers):
            do_kv_cache_update(caches[layer], k[layer], v[layer], slots)
        forward_done = torch.cuda.Event() if forward is not None else None
        if forward_done is not None:
            forward_done.record(forward)
    writers: dict[int, Writer] = {i: partial(do_kv_cache_update, cache) for i, cache in enumerate(caches)}
    copier = KVCopier(dict(enumerate(caches)), writers, block, layout=Layout.TOKEN_KV)
    if forward_done is not None:
        torch.cuda.current_stream(device).wait_event(forward_done)
    copier.save(pool, block_ids, pages, 0, end)
    page_t = torch.tensor(pages, device=device)
    p = torch.arange(end, device=device)
    got_k = pool[page_t[p // page], 0, :, p % page]  # [end, L, H, D]
    got_v = pool[page_t[p // page], 1, :, p % page]
    saved = torch.equal(got_k, k[:, :end].transpose(0, 1)) and torch.equal(got_v, v[:, :end].transpose(0, 1))
    report.check(PART, f"connector save from LBNHC caches after the forward's event ({end} tokens) exact", saved)
    for cache in caches:
        cache.fill_(-3072.0)  # poison, then load back into the same blocks
    copier.load(pool, pages, block_ids, 0, end)
    loaded = all(
        torch.equal(
            cache.transpose(1, 2)[slots[:end] // block, slots[:end] % block], torch.cat([k[i, :end], v[i, :end]], -1)
        )
        for i, cache in enumerate(caches)
    )
    untouched = all(
        bool((cache.transpose(1, 2)[slots[end:] // block, slots[end:] % block] == -3072.0).all()) for cache in caches
    )
    report.check(
        PART, "connector load into poisoned LBNHC caches exact, nothing past the saved tokens", loaded and untouched
    )


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
