"""The tiers under a CUDA pool (skipped without a GPU): spills to pinned host memory and restores from
it, and the remote tier's restore through host rows and one engine copy, each bit for bit with the
attention over the pages first computed."""

from typing import Any

import pytest

from tests.tiers.conftest import RedisServer
from tests.tiers.helpers import run_prompt, same_bits
from tests.tiers.test_remote_http import remote_env, wait_for_keys

CUDA = {"KVPOOL_DEVICE": "cuda"}
NUM_PROMPTS = 16  # 4 pages each: 64 pages, the device pool holds 16


@pytest.mark.gpu
def test_a_cuda_pool_spills_to_pinned_host_memory_and_restores_to_the_bit(start_server: Any) -> None:
    c = start_server({**CUDA, "KVPOOL_SPILL": "host", "KVPOOL_SPILL_BYTES": str(64 * 2200)}).client
    first = [run_prompt(c, f"s{i}", i) for i in range(NUM_PROMPTS)]
    second = [run_prompt(c, f"s{i}", i) for i in range(NUM_PROMPTS)]
    assert [cached for cached, _ in second] == [16] * NUM_PROMPTS  # every prompt back from the host tier
    for (_, a), (_, b) in zip(first, second):
        assert same_bits(a, b)
    pool = c.get("/v1/pool").json()
    assert pool["pages_used"] == 0 and pool["pages_cached"] + pool["pages_free"] == 16


@pytest.mark.gpu
def test_a_prefix_written_by_a_cuda_pool_is_a_hit_on_another_to_the_bit(
    start_server: Any, redis_server: RedisServer
) -> None:
    a = start_server({**CUDA, **remote_env(redis_server)}).client
    b = start_server({**CUDA, **remote_env(redis_server)}).client
    cached, out_a = run_prompt(a, "x", 1)
    assert cached == 0
    wait_for_keys(redis_server, 4)
    cached, out_b = run_prompt(b, "y", 1)
    assert cached == 16 and same_bits(out_a, out_b)
