"""A vLLM engine driven over stdin/stdout, so that tests control one real engine process at a time.

    python -m tests.integrations.vllm_engine '{"model": DIR, "block_size": 32, "kvpool_url": URL or null}'

Optional keys: "dtype" (float32), "kv_cache_dtype" (auto), "kv_role" (kv_both), "max_tokens" (8),
"max_model_len" (1024), "prefix_caching" (false: hits can then only come from kvpool).

Reads one JSON request per line, [{"token_ids": [...], "cache_salt": "..."}, ...], generates them
(greedy, max_tokens new tokens), waits for the connector's saves, and answers one line: {"outputs":
[{"token_ids", "num_cached_tokens"}], "stats": the connector's counters}. The engine runs in this
process (VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

import faulthandler
import json
import os
import signal
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # the tests dump this process's stacks when it does not answer
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    config = json.loads(sys.argv[1])
    transfer = None
    if config.get("kvpool_url"):
        extra = {"kvpool_url": config["kvpool_url"], "timeout_s": 2.0, "retry_interval_s": 0.5}
        transfer = KVTransferConfig(
            kv_connector="KVPoolConnector",
            kv_connector_module_path="service.integrations.vllm",
            kv_role=config.get("kv_role", "kv_both"),
            kv_connector_extra_config=extra,
        )
    llm = LLM(
        model=config["model"],
        skip_tokenizer_init=True,
        dtype=config.get("dtype", "float32"),
        kv_cache_dtype=config.get("kv_cache_dtype", "auto"),
        enforce_eager=True,
        block_size=config.get("block_size", 32),
        max_model_len=config.get("max_model_len", 1024),
        enable_prefix_caching=config.get("prefix_caching", False),
        kv_cache_memory_bytes=64 << 20,
        kv_transfer_config=transfer,
    )
    params = SamplingParams(max_tokens=config.get("max_tokens", 8), temperature=0.0, ignore_eos=True)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        prompts = [
            {"prompt_token_ids": p["token_ids"], **({"cache_salt": p["cache_salt"]} if p.get("cache_salt") else {})}
            for p in json.loads(line)
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = {}
        if has_kv_transfer_group():  # saves run on the connector's thread: let them finish, then count
            get_kv_transfer_group().wait_for_saves()
            stats = get_kv_transfer_group().stats
        answer = [
            {"token_ids": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens} for o in outputs
        ]
        print(json.dumps({"outputs": answer, "stats": stats}), flush=True)


if __name__ == "__main__":
    main()
