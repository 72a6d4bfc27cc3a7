"""Settings, read from KVPOOL_* environment variables (or passed in), validated at start."""

import re
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.tenancy import parse_api_keys, parse_tenant_names

_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVPOOL_", extra="ignore", validate_default=True)

    # Pool geometry: the default is small enough to start in about a second on a laptop CPU.
    num_layers: int = Field(4, ge=1, le=1024, description="transformer layers held in the pool")
    num_kv_heads: int = Field(2, ge=1, le=1024)
    head_dim: int = Field(64, ge=1, le=4096)
    page_size: int = Field(16, ge=1, le=4096, description="tokens per page")
    num_pages: int = Field(512, ge=1, lt=2**31 - 1, description="pages in the pool, the null page not counted")
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N (auto: CUDA when present)")
    enable_prefix_caching: bool = True
    attention_backend: Literal["auto", "triton", "torch"] = Field(
        "auto", description="auto: triton on CUDA, the torch reference on the CPU"
    )

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not _DEVICE.match(value):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, not {value!r}")
        return value

    @model_validator(mode="after")
    def _check_pool_size(self) -> "Settings":
        itemsize = 4 if self.dtype == "float32" else 2
        nbytes = (self.num_pages + 1) * 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim
        if nbytes * itemsize > 2**40:
            raise ValueError(f"the pool would take {nbytes * itemsize / 2**30:.0f} GiB, more than 1 TiB")
        return self

    @property
    def page_nbytes(self) -> int:
        itemsize = 4 if self.dtype == "float32" else 2
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * itemsize

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
    shutdown_grace_s: float = Field(
        0.0, ge=0, le=3600, allow_inf_nan=False, description="on SIGTERM, seconds /readyz answers 503 before draining"
    )

    @field_validator("api_keys")
    @classmethod
    def _check_api_keys(cls, value: SecretStr) -> SecretStr:
        parse_api_keys(value.get_secret_value())
        return value

    @field_validator("ipc_tenants")
    @classmethod
    def _check_ipc_tenants(cls, value: str) -> str:
        parse_tenant_names(value)
        return value

    @model_validator(mode="after")
    def _check_ipc_tenants_have_keys(self) -> "Settings":
        ipc = parse_tenant_names(self.ipc_tenants)
        tenants = set(self.api_key_tenants.values())
        if ipc and not tenants:
            raise ValueError("KVPOOL_IPC_TENANTS names tenants but KVPOOL_API_KEYS is empty, so no caller has one")
        if ipc - tenants:
            raise ValueError(f"KVPOOL_IPC_TENANTS names {sorted(ipc - tenants)}, which have no key in KVPOOL_API_KEYS")
        return self

    @property
    def api_key_tenants(self) -> dict[str, str]:
        """{key: tenant}; empty when API keys are off."""
        return parse_api_keys(self.api_keys.get_secret_value())

    @property
    def ipc_tenant_names(self) -> frozenset[str]:
        return parse_tenant_names(self.ipc_tenants)


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
