"""The vLLM connector's other formats and roles: MLA and FP8 caches, full hits, and the prefill/decode split.

    python -m benchmarks.vllm_connector --mode mla|fp8_e5m2|fp8_e4m3|full-hit|pd [--prompt 2048 --rounds 5]

mla, fp8_*, full-hit: vLLM alone (no connector), then an engine with the connector (computes and saves the
prompts), then a fresh engine with the connector (loads them), each in its own process with the same
thread settings (vllm_timed_engine.Engine: a warm-up prompt, glibc's malloc thresholds fixed); every prompt
is `--prompt` tokens, timed by its time to first token. Printed against the targets: a fresh-process hit
<= 0.25x vLLM alone's cold TTFT, tokens equal vLLM alone's, and an exact repeat caching >= prompt - page
tokens (2,032 of 2,048: page 16, block 32).

pd: kvpool, a kv_producer and a kv_consumer vLLM OpenAI server and a third server without the connector
(same flags, same thread settings), `--requests` requests through pd_proxy.complete one after the other:
the consumer must load >= 95% of each prompt's full pages in every request, tokens equal the server
alone's, and the producer's time (its max_tokens=1 call) at most 10% above the same call on the server
alone (the calls alternate, request by request).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.pd_proxy import complete
from benchmarks.processes import stop
from benchmarks.vllm_connector import make_model, prompts, start_kvpool
from benchmarks.vllm_engine import FIXED_MALLOC, REPO
from benchmarks.vllm_timed_engine import Engine

PAGE = 16


def make_mla_model(path: Path, layers: int, hidden: int) -> None:
    """A DeepSeek-V2 shaped model (MLA: kv_lora_rank 512 + rope 64, vLLM CPU MLA's head size), bf16."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(0)
    shape: dict[str, Any] = dict(
        vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 2, moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=layers,
        max_position_embeddings=8192, torch_dtype="bfloat16",
    )  # fmt: skip
    model: Any = DeepseekV2ForCausalLM(DeepseekV2Config(**shape))
    model.to(torch.bfloat16).save_pretrained(path)


def wait_ready(url: str, proc: subprocess.Popen[Any], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up")


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def run_format(args: argparse.Namespace) -> None:
    mla = args.mode == "mla"
    dtype = "bfloat16" if mla else args.dtype
    cache_dtype = args.mode if args.mode.startswith("fp8") else "auto"
    pool_env = {}
    if cache_dtype != "auto":
        pool_env = {"KVPOOL_DTYPE": {"fp8_e5m2": "float8_e5m2", "fp8_e4m3": "float8_e4m3fn"}[cache_dtype]}
        pool_env["KVPOOL_QUANT_GRANULARITY"] = "64"
    prompt_set = [prompts(200 + i, args.prompt)[0] for i in range(args.rounds)]
    with tempfile.TemporaryDirectory() as tmp:
        model = str(Path(tmp) / "model")
        (make_mla_model if mla else lambda p, la, h: make_model(p, la, h, dtype))(Path(model), args.layers, args.hidden)
        server, url = start_kvpool(model, (args.rounds + 2) * args.prompt // PAGE + 64, pool_env)
        try:
            runs: dict[str, list[dict[str, Any]]] = {}
            for name, engine_url in (("alone", None), ("saving", url), ("fresh", url)):
                engine = Engine(model, engine_url, False, args.prompt, 0, True, dtype, kv_cache_dtype=cache_dtype)
                try:
                    runs[name] = [engine.run(p, 1) for p in prompt_set]
                finally:
                    engine.close()  # (the saving engine's queued saves run at its exit)
        finally:
            stop(server)
    cold = median([r["s"] for r in runs["alone"]])
    hit = median([r["s"] for r in runs["fresh"]])
    cached = [r["cached"] for r in runs["fresh"]]
    equal = all(a["tokens"] == f["tokens"] for a, f in zip(runs["alone"], runs["fresh"], strict=True))
    full = args.prompt - PAGE
    print(f"mode {args.mode}: model {'DeepSeek-V2 MLA' if mla else 'Llama'} {args.layers} layers, hidden "
          f"{args.hidden}, {dtype}, KV cache {cache_dtype}; {args.rounds} prompts of {args.prompt} tokens")  # fmt: skip
    print(f"  vLLM alone, cold TTFT (median): {cold * 1e3:.1f} ms; saving engine cold: "
          f"{median([r['s'] for r in runs['saving']]) * 1e3:.1f} ms")  # fmt: skip
    print(f"  fresh process, kvpool hit TTFT (median): {hit * 1e3:.1f} ms = {hit / cold:.2f}x cold "
          f"(target <= 0.25x: {'met' if hit / cold <= 0.25 else 'NOT met'})")  # fmt: skip
    print(f"  cached tokens per exact repeat: {min(cached)}..{max(cached)} of {args.prompt} "
          f"(target >= {full}: {'met' if min(cached) >= full else 'NOT met'})")  # fmt: skip
    print(f"  tokens equal vLLM alone: {equal} (target: True)")


class Server:
    """A vLLM OpenAI server (its own process and its engine core's) on the CPU, with the connector in `kv_role`
    (or none); the tests' P/D servers too."""

    def __init__(
        self, model: str, kvpool_url: str | None, kv_role: str | None, dtype: str, port: int, log: Path,
        max_model_len: int = 4096, kv_cache_bytes: int = 1 << 30, wait: bool = True,
    ) -> None:  # fmt: skip
        """wait=False: started only (servers start side by side); wait_ready() then."""
        self.url = f"http://127.0.0.1:{port}"
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--skip-tokenizer-init", "--dtype", dtype, "--enforce-eager", "--block-size", "32",
            "--max-model-len", str(max_model_len), "--no-enable-prefix-caching", "--kv-cache-memory-bytes",
            str(kv_cache_bytes), "--enable-prompt-tokens-details",
        ]  # fmt: skip
        if kv_role is not None:
            transfer = {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "service.integrations.vllm",
                        "kv_role": kv_role, "kv_connector_extra_config": {"kvpool_url": kvpool_url}}  # fmt: skip
            cmd += ["--kv-transfer-config", json.dumps(transfer)]
        self.log_path = log
        self.log = log.open("w")
        env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **FIXED_MALLOC}
        # Every server with the same intra-op threads (one per core unless OMP_NUM_THREADS says): left to itself,
        # vLLM picks its threads per process, and the P/D timing compared a producer and a server alone that
        # differed (+50 % there, +11 % with OMP_NUM_THREADS=2 for both, on the same loaded machine).
        env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
        # ... and bound to the same cores: vLLM CPU's automatic binding reserves a core for its scheduler, and
        # one more when a KV connector is set, so a server without one got one core and the producer both
        # (session 11: the producer's call then took 0.56x the server alone's).
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.kv_role = kv_role
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        try:
            wait_ready(f"{self.url}/health", self.proc)
        except RuntimeError:
            self.close()
            raise RuntimeError(
                f"the {self.kv_role} server did not start:\n{self.log_path.read_text()[-3000:]}"
            ) from None

    def close(self) -> None:
        stop(self.proc, timeout=60, close=[self.log])


def run_pd(args: argparse.Namespace) -> None:
    prompt_set = [prompts(300 + i, args.prompt)[0] for i in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        model = str(Path(tmp) / "model")
        make_model(Path(model), args.layers, args.hidden, args.dtype)
        kvpool, url = start_kvpool(model, (args.requests + 2) * args.prompt // PAGE + 64, {})
        servers: list[Server] = []
        rows = []
        try:
            for i, role in enumerate(("kv_producer", "kv_consumer", None)):
                port = 19000 + os.getpid() % 900 + i
                servers.append(Server(model, url, role, args.dtype, port, Path(tmp) / f"{role}.log", wait=False))
            for server in servers:
                server.wait_ready()
            producer, consumer, alone = servers
            body: dict[str, Any] = {"model": model, "max_tokens": args.new, "temperature": 0.0, "ignore_eos": True}
            body["return_token_ids"] = True
            with httpx.Client(timeout=600) as client:
                for server in servers:  # warm-up: a prompt of its own
                    client.post(f"{server.url}/v1/completions", json={**body, "prompt": prompts(1, args.prompt)[0]})
                for i, prompt in enumerate(prompt_set):
                    row: dict[str, Any] = {}
                    for name in ["alone", "pd"] if i % 2 else ["pd", "alone"]:
                        began = time.perf_counter()
                        if name == "pd":
                            row[name] = complete(client, producer.url, consumer.url, {**body, "prompt": prompt})
                        else:
                            answer = client.post(f"{alone.url}/v1/completions", json={**body, "prompt": prompt})
                            row[name] = answer.raise_for_status().json()
                        row[f"{name}_s"] = time.perf_counter() - began
                    rows.append(row)
                # The producer's max_tokens=1 call alone, timed apart (complete() times both calls).
                producer_s: list[float] = []
                alone_s: list[float] = []
                for i, prompt in enumerate(prompts(400 + j, args.prompt)[0] for j in range(args.requests)):
                    one = {**body, "prompt": prompt, "max_tokens": 1}
                    for _name, server, out in sorted(
                        (("producer", producer, producer_s), ("alone", alone, alone_s)), reverse=bool(i % 2)
                    ):
                        began = time.perf_counter()
                        client.post(f"{server.url}/v1/completions", json=one).raise_for_status()
                        out.append(time.perf_counter() - began)
        finally:
            for server in servers:
                server.close()
            stop(kvpool)
    full = [len(p) // PAGE * PAGE for p in prompt_set]
    cached = [r["pd"]["usage"]["prompt_tokens_details"]["cached_tokens"] for r in rows]
    shares = [c / f for c, f in zip(cached, full, strict=True)]
    equal = all(r["pd"]["choices"][0]["token_ids"] == r["alone"]["choices"][0]["token_ids"] for r in rows)
    added = median(producer_s) / median(alone_s) - 1
    print(f"mode pd: Llama {args.layers} layers, hidden {args.hidden}, {args.dtype}; {args.requests} requests of "
          f"{args.prompt} tokens through benchmarks/pd_proxy (producer max_tokens=1, consumer {args.new})")  # fmt: skip
    print(f"  consumer's cached share of each prompt's full pages: min {min(shares):.1%} "
          f"(target >= 95% in every request: {'met' if min(shares) >= 0.95 else 'NOT met'})")  # fmt: skip
    print(f"  tokens equal the server alone: {equal} (target: True)")
    verdict = "met" if added <= 0.10 else "NOT met"
    print(f"  producer's max_tokens=1 call, median: {median(producer_s) * 1e3:.1f} ms; the same on the server "
          f"alone: {median(alone_s) * 1e3:.1f} ms: {added:+.1%} (target <= +10%: {verdict})")  # fmt: skip
    print(f"  end to end through the proxy, median: {median([r['pd_s'] for r in rows]) * 1e3:.1f} ms; the server "
          f"alone: {median([r['alone_s'] for r in rows]) * 1e3:.1f} ms")  # fmt: skip


def main(args: argparse.Namespace) -> None:
    if args.mode == "pd":
        run_pd(args)
    else:
        run_format(args)
