"""Handles through which a process on the same machine maps the pool itself (zero-copy)."""

from fastapi import Depends
from starlette.responses import Response

from service.server.auth import require_ipc_tenant
from service.server.routes.table import RouteTable
from service.server.state import StateDep, json_response
from service.wire.models import IpcOut, error_responses

routes = RouteTable(tags=["ipc"])


@routes.get(
    "/v1/ipc", response_model=IpcOut, dependencies=[Depends(require_ipc_tenant)], responses=error_responses(401, 403)
)
async def ipc(pool: StateDep) -> Response:
    """How to map the pool: its memfd's socket or shared-memory segment (CPU), or CUDA IPC handle (GPU);
    its dtype, shape and strides."""
    return json_response(pool.ipc_description())
