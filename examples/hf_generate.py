"""Greedy generation with a HuggingFace Llama whose every attention layer keeps its KV cache in kvpool.

The model is a tiny Llama built from a config with a fixed seed (random weights, nothing downloaded).
Its attention is replaced, through transformers' AttentionInterface, by a function that sends each
layer's K/V to kvpool and attends over the pool. All prompts of a batch run packed into one row
([1, total tokens]) with explicit positions; kvpool's lookup table keeps the sequences apart.

  mode "http": K/V travel in /v1/attend requests, which write them at the step's slots and attend.
  mode "ipc":  the pool is mapped into this process (GET /v1/ipc); K/V are written through the view
               and attention runs here over the mapped pages: HTTP carries only the bookkeeping.

Start a server with the model's geometry, then run this file:

    KVPOOL_NUM_LAYERS=2 KVPOOL_NUM_KV_HEADS=2 KVPOOL_HEAD_DIM=16 KVPOOL_DTYPE=float32 kvpool serve --port 8000 &
    python -m examples.hf_generate --url http://127.0.0.1:8000 --mode ipc
"""

import argparse
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

from kernels.reference import paged_attention_ref
from service.client import AttachedPool, KVPoolClient, StepResult

ATTN_NAME = "kvpool"


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """2 layers, hidden 64, 4 query heads over 2 KV heads of dim 16, vocabulary 128."""
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        # Wider than the default 0.02: varied output, and greedy choices clear of float noise.
        initializer_range=0.3,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def pool_env(model: LlamaForCausalLM) -> dict[str, str]:
    """KVPOOL_* settings of a pool that holds this model's KV cache (float32, like the model)."""
    c = model.config
    return {
        "KVPOOL_NUM_LAYERS": str(c.num_hidden_layers),
        "KVPOOL_NUM_KV_HEADS": str(c.num_key_value_heads),
        "KVPOOL_HEAD_DIM": str(c.head_dim),
        "KVPOOL_DTYPE": "float32",
    }


@dataclass
class StepBatch:
    """What every attention layer of one forward pass needs: the sequences and this step's bookkeeping."""

    client: KVPoolClient
    pool: AttachedPool | None  # None: K/V go over HTTP
    seq_ids: list[str]
    q_lens: list[int]
    step: StepResult
    query_start_loc: torch.Tensor = field(init=False)  # int64 [batch + 1]

    def __post_init__(self) -> None:
        self.query_start_loc = torch.tensor([0, *self.q_lens], dtype=torch.int64).cumsum(0)


def kvpool_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    kvpool: StepBatch | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query: [1, Hq, T, D], key/value: [1, Hkv, T, D] after RoPE (T = the batch's new tokens) -> [1, T, Hq, D]."""
    assert kvpool is not None, "call the model with kvpool=StepBatch(...)"
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [T, H, D]
    batch = kvpool
    if batch.pool is None:
        out = batch.client.attend(layer, batch.seq_ids, q, batch.q_lens, k=k, v=v, scale=scaling)
    else:
        batch.pool.write(k, v, batch.step.slots, layer=layer)
        device = batch.pool.device  # the pool may sit on a GPU while this model runs on the CPU
        out_ = paged_attention_ref(
            q.to(device),
            batch.pool.blocks,
            layer,
            batch.step.lookup_table.to(device, torch.int64),
            batch.step.cache_lengths.to(torch.int64),
            batch.query_start_loc,
            scale=scaling,
        )
        assert isinstance(out_, torch.Tensor)
        out = out_.to(query.device)
    return out[None], None


AttentionInterface.register(ATTN_NAME, kvpool_attention)


@dataclass
class Generation:
    tokens: list[list[int]]  # generated tokens of each prompt
    logits: list[torch.Tensor]  # [max_new_tokens, vocab] of each prompt: the logits each token was chosen from
    cached_tokens: list[int]  # prompt tokens kvpool already held (prefix cache hits)


@torch.no_grad()
def generate(
    model: LlamaForCausalLM,
    client: KVPoolClient,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    pool: AttachedPool | None = None,
) -> Generation:
    """Greedy decoding of all prompts together, one /v1/step per forward pass; sequences freed at the end."""
    model.set_attn_implementation(ATTN_NAME)
    prefix = uuid.uuid4().hex[:8]
    seq_ids = [f"gen-{prefix}-{i}" for i in range(len(prompts))]
    cached = []
    try:
        for seq_id, prompt in zip(seq_ids, prompts):
            cached.append(client.create_sequence(seq_id, token_ids=list(prompt)).cached_tokens)
        inputs = [list(prompt[c:]) for prompt, c in zip(prompts, cached)]
        tokens: list[list[int]] = [[] for _ in prompts]
        logits: list[list[torch.Tensor]] = [[] for _ in prompts]
        for _ in range(max_new_tokens):
            step = client.step([(s, len(x), x) for s, x in zip(seq_ids, inputs)])
            q_lens = [len(x) for x in inputs]
            batch = StepBatch(client, pool, seq_ids, q_lens, step)
            # positions continue after what the pool already holds: [cache_len, cache_len + q_len)
            positions = torch.cat([torch.arange(c, c + n) for c, n in zip(step.cache_lengths.tolist(), q_lens)])
            input_ids = torch.tensor([t for x in inputs for t in x])
            out = model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False, kvpool=batch)
            last = out.logits[0, batch.query_start_loc[1:] - 1]  # [batch, vocab]: each sequence's last position
            chosen = last.argmax(-1).tolist()
            for i, token in enumerate(chosen):
                tokens[i].append(token)
                logits[i].append(last[i])
            inputs = [[token] for token in chosen]
    finally:
        for seq_id in seq_ids[: len(cached)]:
            client.free(seq_id)
    return Generation(tokens, [torch.stack(x) for x in logits], cached)


@torch.no_grad()
def reference_generate(model: LlamaForCausalLM, prompt: Sequence[int], max_new_tokens: int) -> Generation:
    """transformers' own greedy generate (its dynamic cache, SDPA attention), one prompt at a time."""
    model.set_attn_implementation("sdpa")
    input_ids = torch.tensor([list(prompt)])
    hf_model: Any = model  # transformers' typing of generate() varies between versions
    out = hf_model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return Generation([tokens], [torch.cat(out.logits)], [0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--mode", choices=["http", "ipc"], default="ipc")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args()
    model = tiny_llama()
    prompts = [[5, 17, 99, 3, 42, 8, 1], [64, 2, 77], [9, 9, 31, 120, 14, 6, 55, 23, 71, 12, 4]]
    with KVPoolClient(args.url) as client:
        pool = client.attach() if args.mode == "ipc" else None
        result = generate(model, client, prompts, args.max_new_tokens, pool)
        if pool is not None:
            pool.close()
    for prompt, tokens in zip(prompts, result.tokens):
        ref = reference_generate(model, prompt, args.max_new_tokens).tokens[0]
        verdict = "same" if ref == tokens else "DIFFERENT"
        print(f"prompt {prompt}\n  kvpool       {tokens}\n  transformers {ref}  {verdict}")


if __name__ == "__main__":
    main()
