"""What vLLM's scheduler-side connector hands its worker side each step, the records the scheduler side keeps
(vllm_scheduler), and the model's KV geometry."""

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from service.integrations.kvpool_link import Geometry
from service.integrations.vllm_reserve import Reservation
from service.wire.dtypes import dtype_name

if TYPE_CHECKING:
    from vllm.v1.request import Request

# KV-cache dtypes the connector copies: the model's own ("auto"), or vLLM's FP8 caches, held by kvpool's FP8
# pools of the same format (vLLM's per-layer k_scale / v_scale written as the pages' scales: vllm_blockmap).
SUPPORTED = ("float32", "float16", "bfloat16")
FP8_CACHES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


@dataclass
class LoadJob:
    """Copy tokens [start, start + count) from kvpool `pages` (the pin's, made on server `instance_id`) into vLLM
    `block_ids`. The scheduler holds the pin until every rank has reported the load (KVPoolWorkerMeta.loaded)."""

    req_id: str
    pin_id: str
    pages: list[int]
    start: int
    count: int
    block_ids: list[int]
    instance_id: str


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
    # Requests finished in the last step whose last pages this step saves (or gave up saving): vLLM frees their
    # blocks once every rank has written them (get_finished).
    finish_saved: set[str] = field(default_factory=set)


@dataclass
class KVPoolWorkerMeta(KVConnectorWorkerMetadata):
    """What a worker tells the scheduler after a step, summed over the ranks by vLLM (KVOutputAggregator):
    per save, how many ranks wrote their part and how many could not; per pin, how many ranks are done loading
    from it (read or not); and the workers' counters since their last report."""

    written: Counter[int] = field(default_factory=Counter)
    failed: Counter[int] = field(default_factory=Counter)
    stats: Counter[str] = field(default_factory=Counter)
    loaded: Counter[str] = field(default_factory=Counter)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KVPoolWorkerMeta":
        assert isinstance(other, KVPoolWorkerMeta)
        return KVPoolWorkerMeta(
            self.written + other.written, self.failed + other.failed, self.stats + other.stats,
            self.loaded + other.loaded,
        )  # fmt: skip


Job = TypeVar("Job", LoadJob, SaveJob)


@dataclass(frozen=True)
class Role:
    """What vLLM's kv_role lets this engine do (kv_producer: saves; kv_consumer: loads; kv_both: both), and
    how long a lookup waits for the tokens a producer announced (kv_transfer_params: vllm_scheduler)."""

    loads: bool = True
    saves: bool = True
    load_wait_s: float = 2.0
    reserve: bool = True  # pages appended ahead of their saves, not waited for (vllm_reserve)


@dataclass
class Pin:
    seq_id: str
    pages: list[int]  # the pages of tokens [0, hit)
    hit: int  # cached tokens vLLM is offered: every one but the prompt's last
    cached: int  # cached tokens as kvpool reported them (full pages)
    instance_id: str  # the server instance the pin was made on (whose pool holds its pages)
    start: int = 0  # tokens vLLM had locally when it asked
    reserved: Reservation | None = None  # the prompt's pages appended to it after the lookup (vllm_reserve)


@dataclass
class OpenSave:
    """A save whose ranks have not all reported yet: its sequence holds the appended pages, uncommitted."""

    seq_id: str
    tokens: int  # tokens appended (committed once every rank has written them)
    req_id: str
    end: int  # the sequence's length after the append: tokens [0, end) of the request
    written: int = 0  # ranks that wrote their part
    failed: int = 0  # ranks that could not


@dataclass
class Held:
    """The sequence of a running request's last save, written by every rank: the request's next save appends
    to it (no create, no free in between); freed, committing, when the request finishes."""

    seq_id: str
    end: int  # tokens [0, end) of the request


@dataclass
class Finishing:
    """A finished request whose last pages, tokens [kvpool's, end), the next step saves; vLLM keeps its blocks
    (`block_ids`) until every rank has written them."""

    request: "Request"
    end: int
    block_ids: list[int]
    reserved: Reservation | None = None  # its last pages appended when it finished (vllm_reserve)


def model_geometry(vllm_config: VllmConfig) -> Geometry:
    """The whole model's KV geometry (every layer, every KV head), whatever its ranks hold: kvpool's pages store
    all of it, each tensor parallel rank writing and reading its own KV heads (vllm_worker.Shard)."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        # vLLM 0.32's CPU build cannot run it (its second stage fails `assert self.intermediate_tensors is not
        # None` in gpu_model_runner.sync_and_gather_intermediate_tensors, vLLM alone): untested, so refused.
        raise ValueError("kvpool's vLLM connector does not support pipeline parallelism yet (tensor parallel: yes)")
    cache_dtype = vllm_config.cache_config.cache_dtype
    name = dtype_name(model.dtype) if cache_dtype == "auto" and isinstance(model.dtype, torch.dtype) else None
    name = FP8_CACHES.get(cache_dtype, name)
    if name not in (*SUPPORTED, *FP8_CACHES.values()):
        raise ValueError(
            f"kvpool's vLLM connector needs a float32/float16/bfloat16 or fp8/fp8_e4m3/fp8_e5m2 KV cache, not "
            f"{cache_dtype} (model dtype {model.dtype})"
        )
    layers = model.get_total_num_hidden_layers()
    if model.use_mla:  # one latent per token: kv_lora_rank + rope channels (vLLM's head size), one "head"
        rank = int(model.hf_text_config.kv_lora_rank)
        return Geometry(layers, 1, model.get_head_size(), name, rank)
    return Geometry(layers, model.get_total_num_kv_heads(), model.get_head_size(), name)
