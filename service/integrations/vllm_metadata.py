"""What vLLM's scheduler-side connector hands its worker side each step, and the model's KV geometry."""

from collections import Counter
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from service.integrations.kvpool_link import Geometry
from service.wire.dtypes import dtype_name

# KV-cache dtypes the connector copies (an FP8 cache is refused: kvpool keeps FP8 with scales of its own).
SUPPORTED = ("float32", "float16", "bfloat16")


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
    """Write tokens [start, end) from vLLM `block_ids` (from the request's token 0) into kvpool `pages` (the
    sequence's block table, from its token 0), which the scheduler appended to sequence `seq_id` on server
    `instance_id`: each rank writes its KV heads (and its layers), then reports the save (KVPoolWorkerMeta);
    the scheduler commits the pages once every rank has written its part."""

    save_id: int
    req_id: str
    seq_id: str
    instance_id: str
    pages: list[int]
    start: int
    end: int
    block_ids: list[int]


@dataclass
class KVPoolMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)  # requests vLLM preempted in this step (their blocks freed)


@dataclass
class KVPoolWorkerMeta(KVConnectorWorkerMetadata):
    """What a worker tells the scheduler after a step, summed over the ranks by vLLM (KVOutputAggregator):
    per save, how many ranks wrote their part and how many could not; and the workers' counters since their
    last report."""

    written: Counter[int] = field(default_factory=Counter)
    failed: Counter[int] = field(default_factory=Counter)
    stats: Counter[str] = field(default_factory=Counter)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KVPoolWorkerMeta":
        assert isinstance(other, KVPoolWorkerMeta)
        return KVPoolWorkerMeta(self.written + other.written, self.failed + other.failed, self.stats + other.stats)


Job = TypeVar("Job", LoadJob, SaveJob)


@dataclass
class Pin:
    seq_id: str
    pages: list[int]  # the pages of tokens [0, hit)
    hit: int  # cached tokens, cut to vLLM's block size
    cached: int  # cached tokens as kvpool reported them (full pages)
    start: int = 0  # tokens vLLM had locally when it asked


def model_geometry(vllm_config: VllmConfig) -> Geometry:
    """The whole model's KV geometry (every layer, every KV head), whatever its ranks hold: kvpool's pages store
    all of it, each tensor parallel rank writing and reading its own KV heads (vllm_worker.Shard)."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        # vLLM 0.32's CPU build cannot run it (its second stage fails `assert self.intermediate_tensors is not
        # None` in gpu_model_runner.sync_and_gather_intermediate_tensors, vLLM alone): untested, so refused.
        raise ValueError("kvpool's vLLM connector does not support pipeline parallelism yet (tensor parallel: yes)")
    if model.use_mla:
        raise ValueError("kvpool's vLLM connector does not support MLA models yet")
    cache_dtype = vllm_config.cache_config.cache_dtype
    name = dtype_name(model.dtype) if cache_dtype == "auto" and isinstance(model.dtype, torch.dtype) else None
    if name not in SUPPORTED:
        raise ValueError(f"kvpool's vLLM connector needs a float32/float16/bfloat16 KV cache, not {cache_dtype}")
    return Geometry(model.get_total_num_hidden_layers(), model.get_total_num_kv_heads(), model.get_head_size(), name)
