"""The vLLM connector on an MLA model and on FP8 KV caches, and full hits: real vLLM engines, real `kvpool serve`.

For each format: vLLM alone gives the reference tokens; an engine with the connector computes a prompt
(saving it) and repeats it; a fresh engine process then loads it from kvpool. Tokens equal vLLM alone's
everywhere, and the cached counts are exact: a repeat whose pages kvpool holds caches every token but
the prompt's last (a full hit: vLLM's block is 32 tokens, kvpool's page 16). The harness (Engine, KVPool) is
test_vllm.py's.
"""

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.integrations.test_vllm import Engine, KVPool, model_dir, tokens

__all__ = ["model_dir"]  # the tiny Llama fixture of test_vllm.py, shared

PROMPT = tokens(11, 128)  # 8 pages of 16, 4 blocks of 32: a repeat caches 127
OTHER = tokens(12, 100)  # 6 full pages and a partial one (never committed): caches 96


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny DeepSeek-V2 (MLA: kv_lora_rank 512 + rope 64 = vLLM CPU MLA's head size 576), bf16."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV2Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=2, max_position_embeddings=1024, torch_dtype="bfloat16",
        initializer_range=0.2,  # (the default 0.02 makes this tiny model repeat one token)
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny-deepseek")
    DeepseekV2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return str(path)


def run(model: str, log: Path, prompts: list[list[int]], **options: Any) -> list[dict[str, Any]]:
    """Each prompt in turn on one fresh engine process; its outputs (the counters in the last one's "stats")."""
    engine = Engine(model, options.pop("url", None), log, **options)
    try:
        outputs = [engine.generate(p)[0] for p in prompts]
        outputs[-1]["stats"] = engine.stats
        return outputs
    finally:
        engine.close()


def check_format(model: str, pool: KVPool, logs: Path, alone: bool = True, **options: Any) -> list[list[int]]:
    """An engine with the connector computes PROMPT and OTHER (saving them) and repeats PROMPT; a fresh one
    loads both. Its tokens equal vLLM alone's (or, alone=False, those the first engine computed on its
    misses, when it loaded nothing). The reference tokens of PROMPT and OTHER."""
    first = run(model, logs / "first.log", [PROMPT, PROMPT, OTHER], url=pool.url, **options)
    fresh = run(model, logs / "fresh.log", [PROMPT, OTHER], url=pool.url, **options)
    reference = [first[0]["token_ids"], first[2]["token_ids"]]
    if alone:
        assert [o["token_ids"] for o in run(model, logs / "alone.log", [PROMPT, OTHER], **options)] == reference
    assert first[1]["token_ids"] == reference[0]
    assert [o["token_ids"] for o in fresh] == reference
    assert [o["num_cached_tokens"] for o in first] == [0, 127, 0]
    assert [o["num_cached_tokens"] for o in fresh] == [127, 96]  # another process: hits from kvpool
    stats = fresh[-1]["stats"]
    assert stats["loaded_tokens"] == 127 + 96
    assert not any(k.startswith("faults") or k in ("internal_errors", "load_failures") for k in stats), stats
    info = pool.pool()
    assert (info["pages_used"], info["num_sequences"]) == (0, 0)
    return reference


def test_mla_model_shares_its_latents(mla_model: str, tmp_path: Path) -> None:
    """vLLM's AMX MLA backend (bf16): the latents go through kvpool's MLA pool. The reference of a partial hit
    is vLLM alone hitting the same tokens in its own prefix cache: on this bf16 model vLLM's tokens after a hit
    differ from those of a full prefill (its own cache shows it), so a hit is held to a hit."""
    import torch

    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("vLLM's CPU MLA without AMX (CPU_MLA) runs without prefix hits: vLLM turns prefix caching off")
    pool = KVPool(mla_model, 16)
    try:
        alone = run(mla_model, tmp_path / "alone.log", [PROMPT, OTHER, OTHER], dtype="bfloat16", prefix_caching=True)
        first = run(mla_model, tmp_path / "first.log", [PROMPT, OTHER], url=pool.url, dtype="bfloat16")
        fresh = run(mla_model, tmp_path / "fresh.log", [PROMPT, OTHER], url=pool.url, dtype="bfloat16")
        info = pool.pool()
    finally:
        pool.stop()
    assert [o["num_cached_tokens"] for o in alone] == [0, 0, 96]  # vLLM's own hit: 3 blocks
    assert [o["token_ids"] for o in first] == [alone[0]["token_ids"], alone[1]["token_ids"]]
    assert [o["num_cached_tokens"] for o in fresh] == [127, 96]  # another process: every latent from kvpool
    assert [o["token_ids"] for o in fresh] == [alone[0]["token_ids"], alone[2]["token_ids"]]
    stats = fresh[-1]["stats"]
    assert stats["loaded_tokens"] == 127 + 96
    assert not any(k.startswith("faults") or k in ("internal_errors", "load_failures") for k in stats), stats
    assert (info["mla"], info["kv_lora_rank"], info["num_kv_heads"], info["head_dim"]) == (True, 512, 1, 576)
    assert (info["pages_used"], info["num_sequences"]) == (0, 0)


def test_fp8_e5m2_cache_is_stored_as_it_is(model_dir: str, tmp_path: Path) -> None:
    pool = KVPool(model_dir, 16, KVPOOL_DTYPE="float8_e5m2", KVPOOL_QUANT_GRANULARITY="32")
    try:
        check_format(model_dir, pool, tmp_path, kv_cache_dtype="fp8_e5m2")
        info = pool.pool()
    finally:
        pool.stop()
    assert (info["dtype"], info["scale_dtype"]) == ("float8_e5m2", "float32")


def test_fp8_e4m3_and_fp8_share_one_pool(model_dir: str, tmp_path: Path) -> None:
    """vLLM's "fp8" is e4m3: a fresh engine with it loads what fp8_e4m3 engines saved. (The reference tokens are
    the saving engine's on its misses, when it loaded nothing: vLLM alone's equality is the e5m2 test's.)"""
    pool = KVPool(model_dir, 16, KVPOOL_DTYPE="float8_e4m3fn", KVPOOL_QUANT_GRANULARITY="32")
    try:
        reference = check_format(model_dir, pool, tmp_path, alone=False, kv_cache_dtype="fp8_e4m3")
        fp8 = run(model_dir, tmp_path / "fp8.log", [PROMPT, OTHER], url=pool.url, kv_cache_dtype="fp8")
        info = pool.pool()
    finally:
        pool.stop()
    assert [(o["token_ids"], o["num_cached_tokens"]) for o in fp8] == [(reference[0], 127), (reference[1], 96)]
    assert (info["dtype"], info["scale_dtype"]) == ("float8_e4m3fn", "float32")


def test_a_pool_of_another_format_is_refused(model_dir: str, tmp_path: Path) -> None:
    pool = KVPool(model_dir, 16)  # float32: the model's own dtype, not the FP8 cache's
    try:
        with pytest.raises(RuntimeError) as excinfo:
            Engine(model_dir, pool.url, tmp_path / "refused.log", kv_cache_dtype="fp8_e5m2")
    finally:
        pool.stop()
    message = str(excinfo.value) + (tmp_path / "refused.log").read_text()
    assert "the vLLM model's KV cache is 2 layers x 2 KV heads x head_dim 32, float8_e5m2" in message
