"""The fleet's model: a random Llama with a word-level tokenizer built here (nothing comes from a model hub).

Both clients send text: `vllm bench serve` decodes random token ids into a prompt, LMCache's multi-round QA
writes "hi hi hi ..." prompts and a chat history. A word-level vocabulary keeps the text and the token ids
in step: every word is one token, the tokenizer has no decoder (its decode joins tokens with a space), so a
decoded text encodes back to the same ids, and a conversation's earlier turns tokenize the same in each
later round (its prefix stays a prefix). The vocabulary holds the words LMCache's prompts use, the numbers
it writes, punctuation, and filler words up to VOCAB_SIZE.
"""

import json
from dataclasses import dataclass
from pathlib import Path

VOCAB_SIZE = 4096
SPECIAL = ["[UNK]", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
# The words of LMCache's multi-round QA prompts (benchmarks/third_party/multi_round_qa), split as the
# Whitespace pre-tokenizer splits them (\w+ or a run of other non-space characters).
CLIENT_WORDS = (
    "Hi hi here s some system prompt For user are other context Here question can you tell me a new long story "
    "with happy ending WARMUP I m Here text"
).split()
PUNCTUATION = [*",.:'?#!;-()", "?."]
# A chat turn is its role's token, a space, the text; the prompt ends with the assistant's token.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    kv_heads: int
    max_len: int

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * 64 * 4  # K and V, head_dim 64, float32


def vocabulary() -> list[str]:
    words = list(dict.fromkeys(SPECIAL + CLIENT_WORDS + PUNCTUATION + [str(n) for n in range(1000)]))
    words += [f"w{n}" for n in range(VOCAB_SIZE - len(words))]
    return words


def make_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(vocabulary())}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", bos_token="<s>", eos_token="</s>",
        additional_special_tokens=SPECIAL[3:], model_max_length=1 << 20,
    )  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def make_model(path: Path, shape: ModelShape) -> Path:
    """A random Llama (seed 0) with the tokenizer above, saved in float32 under `path` (once)."""
    marker = path / "shape.json"
    if marker.exists() and json.loads(marker.read_text()) == shape.__dict__:
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=shape.hidden, intermediate_size=shape.hidden * 11 // 4,
        num_hidden_layers=shape.layers, num_attention_heads=shape.hidden // 64, num_key_value_heads=shape.kv_heads,
        head_dim=64, max_position_embeddings=shape.max_len, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).float()  # float32: the pool's dtype follows the saved config
    model.save_pretrained(path)
    make_tokenizer(path)
    marker.write_text(json.dumps(shape.__dict__))
    return path
