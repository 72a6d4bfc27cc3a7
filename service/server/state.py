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


class PoolState:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.instance_id = uuid.uuid4().hex
        self.storage = Storage(settings, self.instance_id)
        self.allocator = PageAllocator(settings.num_pages, settings.enable_prefix_caching)
        self.sequences = SequenceTable(self.allocator, settings.page_size, settings.tenant_max_pages)
        self.engine = Engine(self.storage, settings.attention_backend)
        self.max_attend_tokens = settings.max_attend_tokens or default_max_attend_tokens(self.storage.device.type)
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
        self.engine.close()
        self.storage.close()


def default_max_attend_tokens(device_type: str) -> int:
    """KVPOOL_MAX_ATTEND_TOKENS when it is 0: a cap each device finishes in seconds.

    CPU, 2**24: a 4,096-token prefill in one attend (4,096 x 4,096 pairs) took 1.1-2.5 s on 2 cores
    with 16 query heads of 64 channels (BENCHMARKS.md); a larger model's heads take a few times that.
    CUDA, 2**36: one attend prefilling a 262,144-token prompt; an engine's chunked prefill (chunks of
    a few thousand tokens over a context of up to a million) and decode batches stay far below it.
    """
    return 2**36 if device_type == "cuda" else 2**24


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
