"""Handles through which a process on the same machine maps the pool itself (zero-copy)."""

from fastapi import APIRouter
from starlette.responses import Response

from service.schemas import IpcOut
from service.state import StateDep, json_response

router = APIRouter(prefix="/v1", tags=["ipc"])


@router.get("/ipc", response_model=IpcOut)
async def ipc(pool: StateDep) -> Response:
    """The pool's shared-memory segment (CPU) or CUDA IPC handle (GPU), its dtype, shape and strides."""
    return json_response({**pool.storage.ipc_description(), "instance_id": pool.instance_id})
