"""Request and response models of HTTP API v1: the server validates and documents with them, the client
parses its answers with them.

Requests are strict and refuse unknown fields; responses (`Answer`) ignore unknown fields, so a client
keeps working against a server that has added some.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from service.wire.dtypes import PoolDtype, ScaleDtype, StoredDtype, TensorDtype
from service.wire.errors import ERROR_CODES

# 1 to 128 of [A-Za-z0-9._:-], but not "." or "..": a URL resolves those dot segments away (RFC 3986,
# 5.2.4), so /v1/sequences/.. could never name the sequence. Every other such id is a path segment
# as it is (unreserved characters and ":"). Written without a lookahead, which pydantic's regex
# engine (Rust's) lacks: a first character that is not a dot, or ".x...", or "..x...".
SEQ_ID_PATTERN = (
    r"^(?:[A-Za-z0-9_:-][A-Za-z0-9._:-]{0,127}|\.[A-Za-z0-9_:-][A-Za-z0-9._:-]{0,126}|\.\.[A-Za-z0-9._:-]{1,126})$"
)
SeqId = Annotated[str, StringConstraints(pattern=SEQ_ID_PATTERN)]
# Token ids are unsigned 32-bit, the whole API's one check: vLLM's are int32 and routers read the KV
# events' token ids as u32 (Dynamo's indexer): an id past it would be published and misread there.
TokenId = Annotated[int, Field(ge=0, lt=2**32)]
# Attention parameters become float32 on the device: a value outside float32's normal range would be
# infinite or zero there, and every output NaN (np.finfo(np.float32).max and .tiny).
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38
# Positions in the kernels are 32-bit; a window wider than the context is no window.
MAX_SLIDING_WINDOW = 2**31 - 1


class Strict(BaseModel):
    # strict: no coercion of "3" or true into an integer, which the schema ("type": "integer") rejects.
    # allow_inf_nan=False: pydantic's JSON parser reads NaN and Infinity, which JSON does not have.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Answer(BaseModel):
    # A field the server adds must not break a client that parses with an older copy of this module.
    model_config = ConfigDict(extra="ignore")


class Tensor(Strict):
    dtype: TensorDtype
    shape: list[Annotated[int, Field(ge=0, le=2**31)]] = Field(max_length=8)
    data: str = Field(description="base64 of the C-contiguous little-endian bytes")


class TensorOut(Answer):
    """A tensor in an answer: Tensor's fields, and any a newer server adds ignored."""

    dtype: TensorDtype
    shape: list[int]
    data: str = Field(description="base64 of the C-contiguous little-endian bytes")


def _check_token_ids(num_tokens: int, token_ids: list[int] | None) -> None:
    if token_ids is not None and len(token_ids) != num_tokens:
        raise ValueError(f"token_ids has {len(token_ids)} ids, num_tokens is {num_tokens}")


class CreateSequence(Strict):
    seq_id: SeqId | None = None
    token_ids: list[TokenId] | None = None
    ttl_s: float | None = Field(
        None,
        ge=0,
        le=31_536_000,
        allow_inf_nan=False,
        description="lease in seconds, renewed by every call naming the sequence (a fork inherits it); "
        "freed when it runs out. Default KVPOOL_DEFAULT_TTL_S; 0: no expiry",
    )
    cache_salt: str | None = Field(
        None,
        max_length=1024,
        description="salts the prefix hashes like the tenant does (vLLM's per-request cache_salt): "
        "sequences with different salts never share cached pages",
    )
    reserve_to: int | None = Field(
        None,
        ge=0,
        description="also append token_ids from the end of the cached prefix up to this many tokens (slots whose "
        "K/V the client writes, as an append without k/v; committed by a later step listing the sequence, or its "
        "free), where the pages and the quota allow; where they do not, the sequence holds the cached prefix only: "
        "its length says which. At most len(token_ids)",
    )


class ForkSequence(Strict):
    seq_id: SeqId | None = None


class SequenceOut(Answer):
    seq_id: str
    length: int
    block_table: list[int]
    cached_tokens: int
    ttl_s: float | None = Field(None, description="the lease (present only on leased sequences)")
    expires_in_s: float | None = Field(None, description="seconds left on the lease at this response")
    instance_id: str | None = Field(None, description="the server's instance (only when asked: ?instance=true)")


class AppendRequest(Strict):
    num_tokens: int = Field(ge=1, le=2**31)
    token_ids: list[TokenId] | None = None
    k: Tensor | None = Field(None, description="[num_layers, num_tokens, num_kv_heads, head_dim]")
    v: Tensor | None = Field(None, description="same shape as k")

    @model_validator(mode="after")
    def _check(self) -> "AppendRequest":
        _check_token_ids(self.num_tokens, self.token_ids)
        if self.v is not None and self.k is None:  # k alone is an MLA latent: checked against the pool
            raise ValueError("v needs k")
        return self


class AppendOut(SequenceOut):
    slots: list[int]


class FreeOut(Answer):
    seq_id: str
    freed_pages: int = Field(description="pages whose last reference this free dropped")


class StepAppend(Strict):
    # No Python validator here: it would run once per sequence of every step. The core checks
    # that token_ids has num_tokens ids (422 invalid_request) before changing anything.
    seq_id: SeqId
    num_tokens: int = Field(ge=1, le=2**31)
    token_ids: list[TokenId] | None = None


class StepRequest(Strict):
    appends: list[StepAppend] = Field(default_factory=list)
    seq_ids: list[SeqId] | None = Field(None, description="rows of the lookup table (default: the appended ones)")
    free: list[SeqId] = Field(
        default_factory=list,
        description="sequences freed after the appends, their full pages committed (as DELETE /v1/sequences/{id}); "
        "neither appended nor listed in the same step",
    )
    format: Literal["max", "flashinfer", "flash_attn"] = Field(
        "max", description="extra page tables for FlashInfer (CSR) or flash_attn (block_table); MAX fields always"
    )


class StepOut(Answer):
    lookup_table: TensorOut
    cache_lengths: TensorOut
    input_lengths: list[int]
    max_prompt_length: int
    max_cache_length: int
    sentinel: int
    slots: list[list[int]]
    format: str = "max"
    kv_indptr: TensorOut | None = Field(None, description="flashinfer: int32 [batch + 1]")
    kv_indices: TensorOut | None = Field(None, description="flashinfer: int32 [nnz pages]")
    kv_last_page_len: TensorOut | None = Field(None, description="flashinfer: int32 [batch], 0 for an empty sequence")
    block_table: TensorOut | None = Field(None, description="flash_attn: int32 [batch, max pages]")
    cache_seqlens: TensorOut | None = Field(None, description="flash_attn: int32 [batch], lengths after the step")
    instance_id: str | None = Field(None, description="the server's instance (only when asked: ?instance=true)")


class AttendRequest(Strict):
    layer: int = Field(ge=0)
    seq_ids: list[SeqId] = Field(min_length=1)
    q: Tensor = Field(description="[T, num_q_heads, head_dim]")
    q_lens: list[Annotated[int, Field(ge=1)]] | None = Field(None, description="default: 1 per sequence")
    k: Tensor | None = Field(None, description="[T, num_kv_heads, head_dim], written before attending")
    v: Tensor | None = None
    scale: float | None = Field(
        None, ge=FLOAT32_TINY, le=FLOAT32_MAX, description="default 1/sqrt(head_dim); a normal float32"
    )
    sliding_window: int | None = Field(
        None, ge=1, le=MAX_SLIDING_WINDOW, description="attend to the last W positions only"
    )
    softcap: float | None = Field(
        None,
        ge=FLOAT32_TINY,
        le=FLOAT32_MAX,
        description="logits become softcap * tanh(logits / softcap); a normal float32",
    )

    @model_validator(mode="after")
    def _check(self) -> "AttendRequest":
        if self.v is not None and self.k is None:  # k alone is an MLA latent: checked against the pool
            raise ValueError("v needs k")
        if self.q_lens is not None and len(self.q_lens) != len(self.seq_ids):
            raise ValueError("q_lens needs one entry per seq_id")
        return self


class AttendOut(Answer):
    out: TensorOut


class TierOut(Answer):
    tier: Literal["host", "disk", "remote"]
    capacity_bytes: int | None = Field(description="spill tiers: bytes it can hold; null for the remote tier")
    used_bytes: int | None
    capacity_entries: int | None
    entries: int | None = Field(description="pages it holds (spill tiers)")
    up: bool = Field(description="false during an incident (store down, disk full)")
    queued_pages: int = Field(description="pages waiting to be written (remote)")
    hits: int = Field(description="pages restored from it")
    misses: int
    bytes_in: int
    bytes_out: int
    evictions: int
    errors: int
    skipped: int = Field(description="pages not written: queue full or tier failing")
    rejected: int = Field(description="entries found but not loaded (tokens, geometry or checksum)")
    lookup_seconds: float = Field(description="restores' time asking it which pages it holds (wall time)")
    load_seconds: float = Field(description="restores' time reading pages back from it into the device (wall time)")
    load_wait_seconds: float = Field(
        description="of load_seconds, the remote tier's reads waiting for bytes not yet arrived (0 for spill tiers)"
    )


class PoolOut(Answer):
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int
    dtype: PoolDtype
    device: str
    pages_used: int
    pages_cached: int
    pages_free: int
    num_sequences: int
    sentinel: int
    instance_id: str
    attention_backend: str = Field(description="the backend attention runs on: triton, cpu or torch (from auto)")
    max_attend_tokens: int | None = Field(
        None, description="the cap on one attend's queries x context tokens (KVPOOL_MAX_ATTEND_TOKENS, or the device's)"
    )
    core_compiled: bool = Field(
        False, description="the core's loops run compiled (Cython); false: from their Python source, far slower"
    )
    scale_dtype: ScaleDtype | None = Field(None, description="FP8 pools: dtype of the per-group scales")
    quant_granularity: int | None = Field(None, description="FP8 pools: channels per scale")
    mla: bool = False
    kv_lora_rank: int | None = Field(None, description="MLA pools: value channels of the latent")
    tiers: list[TierOut] = Field([], description="the tiers below the device (KVPOOL_SPILL, KVPOOL_REMOTE_URL)")


class PrefixMatch(Strict):
    token_ids: list[TokenId] = Field(max_length=2**24, description="the prompt")
    cache_salt: str | None = Field(None, max_length=1024, description="as in POST /v1/sequences")


class PrefixMatchOut(Answer):
    cached_tokens: int = Field(description="leading tokens a create with these ids would find cached now")
    num_pages: int = Field(description="cached pages they fill")
    device_pages: int = Field(0, description="of them, pages in the device's prefix cache")
    tier_pages: int = Field(
        0, description="of them, pages the spill tier (KVPOOL_SPILL) holds after those (a create copies them back)"
    )


class CacheResetOut(Answer):
    dropped_pages: int = Field(description="cached (unreferenced) pages dropped from the prefix cache")
    all_cleared: bool = Field(description="no cached or used page is left registered in the prefix cache")


def _describe_codes() -> str:
    return "the code and its HTTP status: " + ", ".join(f"{code} {row.status}" for code, row in ERROR_CODES.items())


def _describe_details() -> str:
    parts = []
    for code, row in ERROR_CODES.items():
        if row.error is not None and row.error.detail_fields:
            parts.append(f"{code} {{{', '.join(row.error.detail_fields)}}}")
    return "the error's fields as data, present where it has some: " + "; ".join(parts)


class ErrorBody(Answer):
    code: str = Field(description=_describe_codes())
    message: str
    details: dict[str, Any] = Field(default_factory=dict, description=_describe_details())


class ErrorOut(Answer):
    error: ErrorBody


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries documenting the error envelope for these statuses."""
    return {status: {"model": ErrorOut} for status in statuses}


class IpcTensor(Answer):
    dtype: StoredDtype
    shape: list[int]
    strides: list[int] = Field(description="in elements")
    handle: dict[str, Any] = Field(
        description='memfd: {"fd_index", "offset", "nbytes"}: the descriptor\'s place among those the socket sends; '
        'posix_shm: {"name", "offset", "nbytes"} of /dev/shm/<name>; '
        'cuda_ipc: a CUDA IPC memory handle of the storage, keyed by "device_uuid"'
    )


class IpcOut(Answer):
    model_config = ConfigDict(extra="allow")  # further pool tensors (e.g. FP8 scales) sit beside blocks

    kind: Literal["memfd", "posix_shm", "cuda_ipc"]
    blocks: IpcTensor
    instance_id: str
    socket: str | None = Field(
        None,
        description="memfd: the Unix-domain socket that hands out the pool's descriptors (owner-only; "
        "the same API key and KVPOOL_IPC_TENANTS rule as this route)",
    )
