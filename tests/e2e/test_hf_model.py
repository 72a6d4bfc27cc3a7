"""A real transformers Llama generating greedily with every attention layer's KV cache in kvpool.

Tokens must equal transformers' own `generate` (its dynamic cache, SDPA attention) token for token
and the logits agree within float32 noise, both with K/V sent over HTTP (/v1/attend) and with K/V
written through the mapped pool (GET /v1/ipc) and only the bookkeeping over HTTP. A second round
starts on pages the first one left in the prefix cache.
"""

from typing import Any

import pytest
import torch

from examples.hf_generate import Generation, generate, pool_env, reference_generate, tiny_llama
from service.client import KVPoolClient

MAX_NEW_TOKENS = 6
# Different lengths, batched together; the last has the first's length and last token, so only
# attention over the cached context can tell their logits apart.
PROMPTS = [[5, 17, 99, 3, 42, 8, 1], [64, 2, 77], [9, 9, 31, 120, 14, 6, 55, 23, 71, 12, 4], [88, 40, 7, 7, 61, 30, 1]]
# Round two shares its first 9 tokens with PROMPTS[2]: with 4-token pages, 2 full pages come from the cache.
SECOND_ROUND = [[9, 9, 31, 120, 14, 6, 55, 23, 71, 100, 101], [33, 34]]
ATOL = RTOL = 1e-4


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def reference(model: Any) -> dict[tuple[int, ...], Generation]:
    return {tuple(p): reference_generate(model, p, MAX_NEW_TOKENS) for p in PROMPTS + SECOND_ROUND}


def check_against_reference(result: Generation, prompts: list[list[int]], reference: Any) -> None:
    for prompt, tokens, logits in zip(prompts, result.tokens, result.logits):
        ref = reference[tuple(prompt)]
        assert tokens == ref.tokens[0], f"prompt {prompt}"
        torch.testing.assert_close(logits, ref.logits[0], atol=ATOL, rtol=RTOL)


def run_rounds(model: Any, server: Any, reference: Any, use_ipc: bool) -> None:
    with KVPoolClient(server.url) as client:
        pool = client.attach() if use_ipc else None
        first = generate(model, client, PROMPTS, MAX_NEW_TOKENS, pool)
        assert first.cached_tokens == [0, 0, 0, 0]
        check_against_reference(first, PROMPTS, reference)

        second = generate(model, client, SECOND_ROUND, MAX_NEW_TOKENS, pool)
        assert second.cached_tokens == [8, 0]
        check_against_reference(second, SECOND_ROUND, reference)

        stats = client.pool()
        assert stats["num_sequences"] == 0 and stats["pages_used"] == 0
        if pool is not None:
            assert not pool.blocks[-1].any(), "the null page must stay zero"
            pool.close()


def test_the_control_prompts_differ_only_through_the_cache(reference: Any) -> None:
    """PROMPTS[0] and PROMPTS[3] share length and last token: their first logits differ only via attention."""
    a, b = reference[tuple(PROMPTS[0])].logits[0][0], reference[tuple(PROMPTS[3])].logits[0][0]
    assert (a - b).abs().max() > 1000 * ATOL


def test_generation_through_http_attend(model: Any, reference: Any, start_server: Any) -> None:
    server = start_server({**pool_env(model), "KVPOOL_NUM_PAGES": "64"})
    run_rounds(model, server, reference, use_ipc=False)


def test_generation_through_the_mapped_pool(model: Any, reference: Any, start_server: Any) -> None:
    server = start_server({**pool_env(model), "KVPOOL_NUM_PAGES": "64"})
    run_rounds(model, server, reference, use_ipc=True)


@pytest.mark.gpu
def test_generation_through_a_cuda_ipc_handle(model: Any, reference: Any, start_server: Any) -> None:
    """The pool on the GPU, opened in this process through its CUDA IPC handle; the model stays on the CPU."""
    server = start_server({**pool_env(model), "KVPOOL_NUM_PAGES": "64", "KVPOOL_DEVICE": "cuda"})
    run_rounds(model, server, reference, use_ipc=True)
