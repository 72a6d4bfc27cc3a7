"""What vLLM's scheduler-side connector hands its worker side each step, and the model's KV geometry."""

from dataclasses import dataclass, field
from typing import TypeVar

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from service.integrations.kvpool_link import Geometry
from service.wire.dtypes import dtype_name

# KV-cache dtypes the connector copies: the model's own ("auto"), or vLLM's FP8 caches, held by kvpool's FP8
# pools of the same format (vLLM's per-layer k_scale / v_scale written as the pages' scales: vllm_blockmap).
SUPPORTED = ("float32", "float16", "bfloat16")
FP8_CACHES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


@dataclass
class LoadJob:
    """Copy tokens [start, start + count) from kvpool `pages` (the pin's) into vLLM `block_ids`."""

    req_id: str
    pin_id: str
    pages: list[int]
    start: int
    count: int
    block_ids: list[int]


@dataclass
class SaveJob:
    """Save tokens [0, end) (the KV of those kvpool does not hold yet) from vLLM `block_ids`.

    token_ids has `end` ids, plus the next one where known (so that kvpool may match the last page).
    pin_id: the request's pin, handed over by the scheduler to its first save: the save appends to it
    (from its `pin_length` tokens, the prefix kvpool held at the lookup) rather than creating a sequence
    from every token id again, and its free commits the pages (the pin is released with it).
    """

    req_id: str
    token_ids: list[int]
    end: int
    block_ids: list[int]
    cache_salt: str | None
    pin_id: str | None = None
    pin_length: int = 0


@dataclass
class KVPoolMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)  # requests vLLM preempted in this step (their blocks freed)


Job = TypeVar("Job", LoadJob, SaveJob)


@dataclass(frozen=True)
class Role:
    """What vLLM's kv_role lets this engine do (kv_producer: saves; kv_consumer: loads; kv_both: both), and
    how long a lookup waits for the tokens a producer announced (kv_transfer_params: vllm_scheduler)."""

    loads: bool = True
    saves: bool = True
    load_wait_s: float = 2.0


@dataclass
class Pin:
    seq_id: str
    pages: list[int]  # the pages of tokens [0, hit)
    hit: int  # cached tokens vLLM is offered: every one but the prompt's last
    cached: int  # cached tokens as kvpool reported them (full pages)
    start: int = 0  # tokens vLLM had locally when it asked


def model_geometry(vllm_config: VllmConfig) -> Geometry:
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ValueError("kvpool's vLLM connector supports one worker (tensor and pipeline parallel size 1)")
    cache_config = vllm_config.cache_config
    cache_dtype = cache_config.cache_dtype
    name = dtype_name(model.dtype) if cache_dtype == "auto" and isinstance(model.dtype, torch.dtype) else None
    name = FP8_CACHES.get(cache_dtype, name)
    if name not in (*SUPPORTED, *FP8_CACHES.values()):
        raise ValueError(
            f"kvpool's vLLM connector needs a float32/float16/bfloat16 or fp8/fp8_e4m3/fp8_e5m2 KV cache, not "
            f"{cache_dtype} (model dtype {model.dtype})"
        )
    layers = model.get_num_layers(parallel)
    if model.use_mla:  # one latent per token: kv_lora_rank + rope channels (vLLM's head size), one "head"
        rank = int(model.hf_text_config.kv_lora_rank)
        return Geometry(layers, 1, model.get_head_size(), name, rank)
    return Geometry(layers, model.get_num_kv_heads(parallel), model.get_head_size(), name)
