"""What routes reach: the app's PoolState (service/pool.py, built once by create_app()) and the caller's
tenant, through dependency aliases; and the JSON response every route answers with."""

from typing import Annotated, Any

import orjson
from fastapi import Depends, Request
from starlette.responses import Response

from service.pool import PoolState


# Dependencies are `async def` on purpose: FastAPI runs plain `def` dependencies in a threadpool,
# which costs two thread hops per request on the hot path.
async def get_state(request: Request) -> PoolState:
    state: PoolState = request.app.state.pool
    return state


async def get_tenant(request: Request) -> str:
    """The tenant a request acts for ("" when API keys are off)."""
    # scope["state"] is what request.state wraps; read directly, a miss costs no AttributeError.
    state: dict[str, Any] = request.scope.get("state") or {}
    return str(state.get("tenant", ""))


StateDep = Annotated[PoolState, Depends(get_state)]
TenantDep = Annotated[str, Depends(get_tenant)]


def json_response(content: Any, status_code: int = 200) -> Response:
    """orjson straight into the body: default pydantic serialization is too slow for the step path.
    numpy arrays in `content` are written as (nested) lists, without a detour through Python lists."""
    body = orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(body, status_code=status_code, media_type="application/json")
