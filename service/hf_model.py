"""Pool geometry from a HuggingFace model: `kvpool serve --model DIR` (or KVPOOL_MODEL).

Reads DIR/config.json (stdlib json only) so that the pool matches the model a vLLM engine runs
(`service.integrations.vllm` refuses a pool whose geometry differs from its model's).
"""

import json
from pathlib import Path
from typing import Any

_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "float": "float32", "half": "float16"}


def pool_geometry(model_dir: str) -> dict[str, Any]:
    """{num_layers, num_kv_heads, head_dim[, dtype]} of the model in `model_dir` (a directory holding config.json).

    head_dim is the config's own when present, else hidden_size / num_attention_heads; num_kv_heads
    defaults to num_attention_heads (no GQA); the dtype comes from `dtype` (transformers >= 5) or
    `torch_dtype`, and is left out when the config names none or one the pool cannot hold. An MLA model
    (its config has kv_lora_rank) gets an MLA pool: 1 KV head of kv_lora_rank + qk_rope_head_dim channels.
    """
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read the model's config {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    top, config = config, config.get("text_config", config)  # multimodal configs nest the language model's
    try:
        num_heads = int(config["num_attention_heads"])
        geometry: dict[str, Any] = {
            "num_layers": int(config["num_hidden_layers"]),
            "num_kv_heads": int(config.get("num_key_value_heads") or num_heads),
            "head_dim": int(config.get("head_dim") or int(config["hidden_size"]) // num_heads),
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"{path} lacks the geometry of a decoder (num_hidden_layers, num_attention_heads, ...): {exc}"
        ) from None
    if config.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3): one latent per token, kv_lora_rank + rope channels
        rank = int(config["kv_lora_rank"])
        geometry |= {"mla": True, "kv_lora_rank": rank, "num_kv_heads": 1}
        geometry["head_dim"] = rank + int(config.get("qk_rope_head_dim") or 0)
    named = [c.get("dtype") or c.get("torch_dtype") for c in (config, top)]
    dtype = _DTYPES.get(str(next((n for n in named if n), "")))
    if dtype:
        geometry["dtype"] = dtype
    return geometry
