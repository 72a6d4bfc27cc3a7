"""Settings, read from KVPOOL_* environment variables (or passed in), validated at start."""

import re
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.hf_model import pool_geometry
from service.remote_url import SCHEMES, is_cluster_url, parse_cluster_url
from service.tenancy import parse_api_keys, parse_tenant_names
from service.wire.dtypes import DTYPES, FP8_DTYPES, PoolDtype, ScaleDtype

_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVPOOL_", extra="ignore", validate_default=True)

    model: str = Field(
        "",
        description="a HuggingFace model directory: its config.json sets num_layers, num_kv_heads, head_dim "
        "and dtype, unless those are given too",
    )
    # Pool geometry: the default is small enough to start in about a second on a laptop CPU.
    num_layers: int = Field(4, ge=1, le=1024, description="transformer layers held in the pool")
    num_kv_heads: int = Field(2, ge=1, le=1024)
    head_dim: int = Field(64, ge=1, le=4096)
    page_size: int = Field(16, ge=1, le=4096, description="tokens per page")
    num_pages: int = Field(512, ge=1, lt=2**31 - 1, description="pages in the pool, the null page not counted")
    dtype: PoolDtype = "float32"
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N (auto: CUDA when present)")
    enable_prefix_caching: bool = True
    attention_backend: Literal["auto", "triton", "cpu", "torch"] = Field(
        "auto",
        description="auto: triton on CUDA, cpu on the CPU (decode of float32 pools compiled, the rest "
        "through the torch reference); torch: the torch reference only",
    )
    shared_memory: Literal["auto", "memfd", "posix_shm"] = Field(
        "auto",
        description="how a CPU pool is shared with frontends: memfd (sealed against resizing, handed over the "
        "server's Unix socket; Linux), posix_shm (a named /dev/shm segment: the fallback), auto: memfd where "
        "the system has it",
    )
    ipc_socket_dir: str = Field(
        "",
        description="memfd pools: the directory for the socket that hands out the pool's descriptor (a private "
        "subdirectory is made in it); empty: $XDG_RUNTIME_DIR or the temporary directory. Frontends in other "
        "containers need it on a volume they share",
    )
    # FP8 pools (dtype float8_e4m3fn or float8_e5m2): one scale per token, head and group of g channels.
    scale_dtype: ScaleDtype = "float32"
    quant_granularity: int = Field(128, ge=1, le=4096, description="channels per FP8 scale; divides head_dim")
    # MLA pools: one latent of head_dim channels per token; the values are its first kv_lora_rank.
    mla: bool = False
    kv_lora_rank: int = Field(512, ge=1, le=4096, description="MLA: value width, < head_dim")

    # Tiers below the device (service/tiers/): evicted pages spill to host memory or a disk file, and
    # committed pages go to a shared Redis/Valkey store; a prefix lookup continues into them.
    spill: Literal["none", "host", "disk"] = Field(
        "none", description="the spill tier: host (pinned memory on CUDA) or disk (a file in spill_path)"
    )
    spill_bytes: int = Field(2**30, ge=0, description="capacity of the spill tier in bytes")
    spill_path: str = Field("", description="disk spill: the directory of the spill file (a local NVMe)")
    remote_url: str = Field(
        "", description="the remote tier: redis://host:6379/0 (Redis or Valkey), redis+cluster://h:p,h:p; empty: off"
    )
    remote_ttl_s: int = Field(3600, ge=1, description="TTL of each page written to the remote tier")
    remote_timeout_s: float = Field(0.5, gt=0, le=60, allow_inf_nan=False, description="per command to the store")
    remote_queue_pages: int = Field(4096, ge=1, description="pages queued for the remote tier; more are skipped")
    remote_secret: SecretStr = Field(
        SecretStr(""),
        description="the remote tier's entries authenticated: a keyed MAC (AES-GMAC) with this secret (16 "
        "characters at least; every node sharing the store sets the same) replaces the checksum, and only "
        "entries made with it are loaded; empty: a checksum only (the store is trusted)",
    )

    @model_validator(mode="after")
    def _check_tiers(self) -> "Settings":
        if (self.spill != "none" or self.remote_url) and not self.enable_prefix_caching:
            raise ValueError("KVPOOL_SPILL and KVPOOL_REMOTE_URL need KVPOOL_ENABLE_PREFIX_CACHING=true")
        if self.spill == "disk" and not self.spill_path:
            raise ValueError("KVPOOL_SPILL=disk needs KVPOOL_SPILL_PATH, a directory for the spill file")
        if self.spill != "none" and self.spill_bytes < self.page_nbytes + 64:
            raise ValueError(f"KVPOOL_SPILL_BYTES={self.spill_bytes} holds no page of {self.page_nbytes} bytes")
        if self.remote_url and not self.remote_url.startswith(SCHEMES):
            raise ValueError("KVPOOL_REMOTE_URL must be a redis://, rediss://, unix:// or redis+cluster:// URL")
        if 0 < len(self.remote_secret.get_secret_value()) < 16:
            raise ValueError("KVPOOL_REMOTE_SECRET must be 16 characters at least (e.g. `openssl rand -hex 32`)")
        if is_cluster_url(self.remote_url):
            try:
                parse_cluster_url(self.remote_url)
            except ValueError as exc:
                raise ValueError(f"KVPOOL_REMOTE_URL: {exc}") from None
        return self

    @model_validator(mode="before")
    @classmethod
    def _geometry_from_model(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("model"):
            return {**pool_geometry(str(data["model"])), **data}  # settings given explicitly win
        return data

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not _DEVICE.match(value):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, not {value!r}")
        return value

    @model_validator(mode="after")
    def _check_pool_size(self) -> "Settings":
        check_formats(self)
        if (self.num_pages + 1) * self.page_nbytes > 2**40:
            raise ValueError(
                f"the pool would take {(self.num_pages + 1) * self.page_nbytes / 2**30:.0f} GiB, more than 1 TiB"
            )
        return self

    @property
    def geometry_tag(self) -> str:
        """What must match for two pools to share pages, as a key part (e.g. L4.H2.D64.P16.float32)."""
        tag = f"L{self.num_layers}.H{self.num_kv_heads}.D{self.head_dim}.P{self.page_size}.{self.dtype}"
        if self.dtype in FP8_DTYPES:
            tag += f".g{self.quant_granularity}.{self.scale_dtype}"
        if self.mla:
            tag += f".mla{self.kv_lora_rank}"
        return tag

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page across all layers, FP8 scales included."""
        return page_nbytes(self)

    # -- trust: API keys and tenants, leases, shutdown, request limits ---------------------------
    api_keys: SecretStr = Field(
        SecretStr(""), description="tenant:key,... (empty: no auth, every caller is the one tenant '')"
    )
    tenant_max_pages: int = Field(0, ge=0, description="pages one tenant may hold (block-table entries); 0: no cap")
    ipc_tenants: str = Field("", description="comma-separated tenants that may fetch GET /v1/ipc")
    default_ttl_s: float = Field(
        0.0, ge=0, le=31_536_000, allow_inf_nan=False, description="lease of a new sequence in seconds; 0: none"
    )
    lease_sweep_interval_s: float = Field(1.0, gt=0, le=3600, allow_inf_nan=False, description="lease sweeper period")
    max_request_bytes: int = Field(64 * 2**20, ge=1024, description="larger request bodies get 413")
    max_attend_tokens: int = Field(
        0,
        ge=0,
        description="attention work one attend may ask for: the sum over its sequences of queries x context "
        "tokens; more is refused with 422 attend_too_large before any work. 0: by device, 2**22 on the CPU "
        "(a 2,048-token prompt prefilled in one call), 2**36 on CUDA (a 262,144-token one)",
    )
    # -- connections (service/server/connections.py) --------------------------------------------------
    max_connections: int = Field(
        4096,
        ge=1,
        description="open connections at most (lowered to what the open-file limit leaves); over it the oldest "
        "connection with no request in flight is closed, or the new one gets 503 when all are busy",
    )
    request_head_timeout_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="seconds a connection may take to start a request (its head), from connecting or from its "
        "previous answer; then it is closed",
    )
    request_body_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="seconds from a request's head to the end of its body; then 408 and the connection is closed",
    )
    keep_alive_timeout_s: int = Field(
        5, ge=1, le=3600, description="seconds an idle keep-alive connection stays open after an answer (uvicorn's)"
    )
    shutdown_grace_s: float = Field(
        0.0, ge=0, le=3600, allow_inf_nan=False, description="on SIGTERM, seconds /readyz answers 503 before draining"
    )

    admin_tenants: str = Field("", description="comma-separated tenants that may POST /v1/prefix_cache/reset")

    # -- KV events: vLLM's wire format over ZeroMQ, for cache-aware routers (service/events) --------
    kv_events_endpoint: str = Field(
        "", description="ZeroMQ PUB endpoint of KV events, e.g. tcp://*:5557 (bound; empty: no events)"
    )
    kv_events_replay_endpoint: str = Field("", description="ZeroMQ ROUTER endpoint answering replay requests")
    kv_events_topic: str = Field("", max_length=1024, description="topic frame of every KV event message")
    kv_events_buffer: int = Field(10_000, ge=1, le=10_000_000, description="KV event batches kept for replay")
    kv_events_buffer_bytes: int = Field(
        64 << 20, ge=1, le=1 << 40, description="bytes of KV event batches (their payloads) kept for replay"
    )
    kv_events_queue: int = Field(
        100_000, ge=1, le=10_000_000, description="KV events waiting for the publisher thread; past it, dropped"
    )
    kv_events_hash_format: Literal["bytes", "int"] = Field(
        "int", description="block hashes as vLLM's int (the last 8 bytes, big-endian; its default), or as 32 bytes"
    )

    @field_validator("kv_events_endpoint", "kv_events_replay_endpoint")
    @classmethod
    def _check_endpoint(cls, value: str) -> str:
        if value and not re.match(r"^(tcp|ipc|inproc)://.+", value):
            raise ValueError(f"a ZeroMQ endpoint is tcp://host:port, ipc://path or inproc://name, not {value!r}")
        return value

    @model_validator(mode="after")
    def _check_kv_events(self) -> "Settings":
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("KVPOOL_KV_EVENTS_REPLAY_ENDPOINT needs KVPOOL_KV_EVENTS_ENDPOINT")
        return self

    @field_validator("api_keys")
    @classmethod
    def _check_api_keys(cls, value: SecretStr) -> SecretStr:
        parse_api_keys(value.get_secret_value())
        return value

    @field_validator("ipc_tenants", "admin_tenants")
    @classmethod
    def _check_ipc_tenants(cls, value: str) -> str:
        parse_tenant_names(value)
        return value

    @model_validator(mode="after")
    def _check_ipc_tenants_have_keys(self) -> "Settings":
        tenants = set(self.api_key_tenants.values())
        for variable, names in (("KVPOOL_IPC_TENANTS", self.ipc_tenants), ("KVPOOL_ADMIN_TENANTS", self.admin_tenants)):
            named = parse_tenant_names(names)
            if named and not tenants:
                raise ValueError(f"{variable} names tenants but KVPOOL_API_KEYS is empty, so no caller has one")
            if named - tenants:
                raise ValueError(f"{variable} names {sorted(named - tenants)}, which have no key in KVPOOL_API_KEYS")
        return self

    @property
    def api_key_tenants(self) -> dict[str, str]:
        """{key: tenant}; empty when API keys are off."""
        return parse_api_keys(self.api_keys.get_secret_value())

    @property
    def ipc_tenant_names(self) -> frozenset[str]:
        return parse_tenant_names(self.ipc_tenants)

    @property
    def admin_tenant_names(self) -> frozenset[str]:
        return parse_tenant_names(self.admin_tenants)


def check_formats(s: Settings) -> None:
    """FP8 and MLA settings that only make sense together with the geometry."""
    if s.dtype in FP8_DTYPES and s.head_dim % s.quant_granularity:
        raise ValueError(
            f"KVPOOL_QUANT_GRANULARITY={s.quant_granularity} must divide KVPOOL_HEAD_DIM={s.head_dim} "
            f"when KVPOOL_DTYPE={s.dtype}"
        )
    if s.mla:
        if s.num_kv_heads != 1:
            raise ValueError(
                f"KVPOOL_MLA=true stores one latent per token: KVPOOL_NUM_KV_HEADS must be 1, not {s.num_kv_heads}"
            )
        if s.kv_lora_rank >= s.head_dim:
            raise ValueError(
                f"KVPOOL_KV_LORA_RANK={s.kv_lora_rank} must be less than KVPOOL_HEAD_DIM={s.head_dim} "
                "(the latent is kv_lora_rank value channels plus the rope channels)"
            )
        if s.dtype in FP8_DTYPES:
            raise ValueError(f"KVPOOL_MLA=true with KVPOOL_DTYPE={s.dtype} is not supported yet")


def page_nbytes(s: Settings) -> int:
    kv = 1 if s.mla else 2
    per_layer = kv * s.page_size * s.num_kv_heads * s.head_dim * DTYPES[s.dtype].itemsize
    if s.dtype in FP8_DTYPES:
        scales = s.head_dim // s.quant_granularity
        per_layer += kv * s.page_size * s.num_kv_heads * scales * DTYPES[s.scale_dtype].itemsize
    return s.num_layers * per_layer


def describe_errors(exc: Exception) -> str:
    """One line per invalid setting, named as the environment variable that sets it."""
    errors = getattr(exc, "errors", None)
    if errors is None:
        return str(exc)
    lines = []
    for err in errors():
        name = "KVPOOL_" + "_".join(str(p) for p in err["loc"]).upper() if err["loc"] else "settings"
        # Never echo keys; a model-level error's input is every setting, keys included.
        got = "" if name == "KVPOOL_API_KEYS" or not err["loc"] else f" (got {err.get('input')!r})"
        lines.append(f"{name}: {err['msg']}{got}")
    return "\n".join(lines)
