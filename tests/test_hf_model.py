"""`kvpool serve --model DIR` / KVPOOL_MODEL: the pool's geometry from a HuggingFace config.json."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from service.config import Settings
from tests.conftest import REPO


def write_config(path: Path, **config: object) -> str:
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_geometry_and_dtype_come_from_the_config_unless_given(tmp_path: Path) -> None:
    model = write_config(
        tmp_path, num_hidden_layers=8, hidden_size=512, num_attention_heads=8, num_key_value_heads=4, dtype="bfloat16"
    )
    s = Settings(model=model)
    assert (s.num_layers, s.num_kv_heads, s.head_dim, s.dtype) == (8, 4, 64, "bfloat16")
    s = Settings(model=model, dtype="float32", num_layers=2)  # given settings win
    assert (s.num_layers, s.num_kv_heads, s.head_dim, s.dtype) == (2, 4, 64, "float32")


def test_head_dim_kv_heads_and_torch_dtype_fallbacks(tmp_path: Path) -> None:
    # An explicit head_dim wins over hidden/heads; no num_key_value_heads means MHA; older configs say torch_dtype.
    model = write_config(
        tmp_path, num_hidden_layers=3, hidden_size=96, num_attention_heads=2, head_dim=128, torch_dtype="float16"
    )
    s = Settings(model=model)
    assert (s.num_layers, s.num_kv_heads, s.head_dim, s.dtype) == (3, 2, 128, "float16")


def test_a_missing_or_partial_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read the model's config"):
        Settings(model=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="lacks the geometry of a decoder"):
        Settings(model=write_config(tmp_path, hidden_size=64))


def test_kvpool_serve_takes_model(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--model", str(tmp_path / "nowhere")],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode != 0
    assert "cannot read the model's config" in run.stderr


def test_an_mla_config_makes_an_mla_pool(tmp_path: Path) -> None:
    """DeepSeek-V2/V3: one latent per token of kv_lora_rank + qk_rope_head_dim channels, one KV head."""
    model = write_config(
        tmp_path, num_hidden_layers=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, torch_dtype="bfloat16",
    )  # fmt: skip
    s = Settings(model=model)
    assert (s.num_layers, s.num_kv_heads, s.head_dim, s.dtype) == (4, 1, 576, "bfloat16")
    assert (s.mla, s.kv_lora_rank) == (True, 512)
