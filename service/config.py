"""Settings, read from KVPOOL_* environment variables (or passed in), validated at start."""

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

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


def describe_errors(exc: Exception) -> str:
    """One line per invalid setting, named as the environment variable that sets it."""
    errors = getattr(exc, "errors", None)
    if errors is None:
        return str(exc)
    lines = []
    for err in errors():
        name = "KVPOOL_" + "_".join(str(p) for p in err["loc"]).upper() if err["loc"] else "settings"
        lines.append(f"{name}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)
