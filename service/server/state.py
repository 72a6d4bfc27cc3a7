"""Everything one app owns, built once by create_app(), reached through dependency aliases."""

import uuid
from typing import Annotated, Any

import orjson
from fastapi import Depends, Request
from starlette.responses import Response

from service.config import Settings
from service.core.allocator import PageAllocator
from service.core.sequences import Sequence, SequenceTable
from service.engine.engine import Engine
from service.engine.storage import Storage
from service.tiers.manager import Tiers


class PoolState:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.instance_id = uuid.uuid4().hex
        self.storage = Storage(settings, self.instance_id)
        self.allocator = PageAllocator(settings.num_pages, settings.enable_prefix_caching)
        self.sequences = SequenceTable(self.allocator, settings.page_size, settings.tenant_max_pages)
        self.engine = Engine(self.storage, settings.attention_backend)
        self.tiers: Tiers | None = None
        if settings.spill != "none" or settings.remote_url:
            try:
                self.tiers = Tiers(self)
            except BaseException:
                self.engine.close()
                self.storage.close()
                raise
        self.ready = True

    def sequence_body(self, seq: Sequence) -> dict[str, Any]:
        body = {
            "seq_id": seq.seq_id,
            "length": self.sequences.length(seq),
            "block_table": self.sequences.block_table(seq),
            "cached_tokens": seq.cached_tokens,
        }
        if seq.ttl_s:  # leased sequences only, so bodies without a lease keep their shape
            body["ttl_s"] = seq.ttl_s
            body["expires_in_s"] = self.sequences.expires_in(seq, self.sequences.clock())
        return body

    def close(self) -> None:
        self.ready = False
        if self.tiers is not None:
            self.tiers.stop()
        self.engine.close()
        if self.tiers is not None:
            self.tiers.close()
        self.storage.close()


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
