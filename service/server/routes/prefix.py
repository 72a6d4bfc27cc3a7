"""The prefix cache as a router sees it: how much of a prompt this pool holds, and clearing it."""

from fastapi import Request
from starlette.responses import Response

from service.core.errors import Forbidden
from service.pool import PoolState
from service.server.bodies import read_json
from service.server.routes.table import RouteTable
from service.server.state import StateDep, TenantDep, json_response
from service.wire.models import CacheResetOut, PrefixMatch, PrefixMatchOut, error_responses

routes = RouteTable(tags=["prefix cache"])


MATCH_ERRORS = error_responses(401, 413, 422)


@routes.post("/v1/prefix/match", body=PrefixMatch, response_model=PrefixMatchOut, responses=MATCH_ERRORS)
async def match_prefix(request: Request, pool: StateDep, tenant: TenantDep) -> Response:
    """How many leading tokens of a prompt the caller's tenant would get from the prefix cache now,
    the spill tier (host/disk) included; allocates nothing, pins nothing, moves nothing in the
    eviction order of the device or the tier."""
    body = await read_json(request, PrefixMatch)
    device, tier = pool.cache.match(body.token_ids, tenant, body.cache_salt or "")
    num_pages = device + tier
    return json_response(
        {
            "cached_tokens": num_pages * pool.settings.page_size,
            "num_pages": num_pages,
            "device_pages": device,
            "tier_pages": tier,
        }
    )


@routes.post("/v1/prefix_cache/reset", response_model=CacheResetOut, responses=error_responses(401, 403))
async def reset_prefix_cache(pool: StateDep, tenant: TenantDep) -> Response:
    """Drop every cached, unreferenced page of every tenant (pages in use stay); admin tenants only."""
    require_admin(pool, tenant)
    dropped = pool.allocator.reset_cache()
    return json_response({"dropped_pages": dropped, "all_cleared": not pool.allocator.has_registered_pages()})


def require_admin(pool: PoolState, tenant: str) -> None:
    """With API keys on, only tenants in KVPOOL_ADMIN_TENANTS (403 `forbidden` for the others; with
    none named, nobody). With keys off the server trusts whoever reaches it, as for GET /v1/ipc."""
    if pool.settings.api_keys.get_secret_value() and tenant not in pool.settings.admin_tenant_names:
        raise Forbidden(
            f"tenant {tenant!r} may not reset the prefix cache: it drops every tenant's cached pages "
            "(allowed tenants are listed in KVPOOL_ADMIN_TENANTS)"
        )
