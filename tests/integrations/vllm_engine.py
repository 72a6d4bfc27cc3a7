"""A vLLM engine driven over stdin/stdout, so that tests control one real engine process at a time.

    python -m tests.integrations.vllm_engine '{"model": DIR, "block_size": 32, "kvpool_url": URL or null,
        "tensor_parallel_size": 1, "pipeline_parallel_size": 1}'

Optional keys: "dtype" (float32), "kv_cache_dtype" (auto), "kv_role" (kv_both), "max_tokens" (8),
"max_model_len" (1024), "prefix_caching" (false: hits can then only come from kvpool).

Reads one JSON request per line, [{"token_ids": [...], "cache_salt": "..."}, ...], generates them
(greedy, max_tokens new tokens), lets the connector's saves land (vLLM's steps bring the ranks' reports of
them, and the scheduler commits them), and answers one line: {"outputs": [{"token_ids",
"num_cached_tokens"}], "stats": the connector's counters}. A line {"kill_rank": r, "token_ids": [...]}
generates one prompt and SIGKILLs worker rank r at once, as that rank saves it. The engine core runs in
this process (VLLM_ENABLE_V1_MULTIPROCESSING=0); with tensor or pipeline parallelism its workers are
processes of their own (the "ready" line names their pids).
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

    from benchmarks.vllm_connector import settle

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
    parallel = {
        "tensor_parallel_size": config.get("tensor_parallel_size", 1),
        "pipeline_parallel_size": config.get("pipeline_parallel_size", 1),
    }
    if parallel["tensor_parallel_size"] * parallel["pipeline_parallel_size"] > 1:
        parallel["distributed_executor_backend"] = "mp"
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
        **parallel,
    )
    params = SamplingParams(max_tokens=config.get("max_tokens", 8), temperature=0.0, ignore_eos=True)
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    workers = {w.rank: w.proc.pid for w in getattr(executor, "workers", ())}  # (a MultiprocExecutor's)
    print(json.dumps({"ready": True, "workers": workers}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if isinstance(request, dict):  # {"kill_rank": r, "token_ids": [...]}
            one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            out = llm.generate([{"prompt_token_ids": request["token_ids"]}], one, use_tqdm=False)[0]
            os.kill(workers[request["kill_rank"]], signal.SIGKILL)  # its save was queued before the step ended
            print(json.dumps({"outputs": [{"token_ids": list(out.outputs[0].token_ids)}], "stats": {}}), flush=True)
            continue
        prompts = [
            {"prompt_token_ids": p["token_ids"], **({"cache_salt": p["cache_salt"]} if p.get("cache_salt") else {})}
            for p in request
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = settle(llm)
        answer = [
            {"token_ids": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens} for o in outputs
        ]
        print(json.dumps({"outputs": answer, "stats": stats}), flush=True)


if __name__ == "__main__":
    main()
