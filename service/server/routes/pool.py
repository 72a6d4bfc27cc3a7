"""The pool's geometry and occupancy, and the health probes."""

from typing import Any

from starlette.responses import Response

import service.core
from service.config import Settings
from service.server.errors import error_response
from service.server.routes.table import RouteTable
from service.server.state import StateDep, json_response
from service.wire.dtypes import FP8_DTYPES
from service.wire.errors import status_of
from service.wire.models import PoolOut, error_responses

routes = RouteTable(tags=["pool"])


@routes.get("/v1/pool", response_model=PoolOut, responses=error_responses(401))
async def pool_info(pool: StateDep) -> Response:
    """Geometry, dtype, device and page occupancy (used + cached + free == num_pages)."""
    s, a = pool.settings, pool.allocator
    return json_response(
        {
            "num_layers": s.num_layers,
            "num_kv_heads": s.num_kv_heads,
            "head_dim": s.head_dim,
            "page_size": s.page_size,
            "num_pages": s.num_pages,
            "dtype": s.dtype,
            "device": str(pool.storage.device),
            "pages_used": a.num_used,
            "pages_cached": a.num_cached,
            "pages_free": a.num_free,
            "num_sequences": len(pool.sequences),
            "sentinel": pool.sequences.sentinel,
            "instance_id": pool.instance_id,
            "attention_backend": pool.engine.backend,
            "core_compiled": service.core.is_compiled(),
            "max_attend_tokens": pool.max_attend_tokens,
            **format_fields(s),
            "tiers": pool.cache.report(),
        }
    )


def format_fields(s: Settings) -> dict[str, Any]:
    """FP8 and MLA settings; the ones that do not apply to this pool are null."""
    fp8 = s.dtype in FP8_DTYPES
    return {
        "scale_dtype": s.scale_dtype if fp8 else None,
        "quant_granularity": s.quant_granularity if fp8 else None,
        "mla": s.mla,
        "kv_lora_rank": s.kv_lora_rank if s.mla else None,
    }


@routes.get("/healthz")
async def healthz() -> Response:
    """The process is alive."""
    return json_response({"status": "ok"})


@routes.get("/readyz", responses=error_responses(503))
async def readyz(pool: StateDep) -> Response:
    """The pool is allocated and the server takes requests (503 while shutting down)."""
    if not pool.ready:
        return error_response(status_of("not_ready"), "not_ready", "shutting down")
    return json_response({"status": "ready", "instance_id": pool.instance_id})
