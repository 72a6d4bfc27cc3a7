"""Everything one app owns, built once by create_app(), reached through dependency aliases."""

import uuid
from collections.abc import Callable
from typing import Annotated, Any

import orjson
from fastapi import Depends, Request
from starlette.responses import Response

from service.config import Settings
from service.core.allocator import PageAllocator
from service.core.sequences import Sequence, SequenceTable
from service.engine.engine import Engine
from service.engine.storage import Storage
from service.ipc.fd_socket import FdServer


class PoolState:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.instance_id = uuid.uuid4().hex
        self.storage = Storage(settings, self.instance_id)
        self.allocator = PageAllocator(settings.num_pages, settings.enable_prefix_caching)
        self.sequences = SequenceTable(self.allocator, settings.page_size, settings.tenant_max_pages)
        self.engine = Engine(self.storage, settings.attention_backend)
        self.ipc_socket: FdServer | None = None  # memfd pools: where frontends get the descriptors
        self.ready = True

    def open_ipc_socket(self, authorize: Callable[[str | None], None]) -> None:
        """memfd pools: serve the descriptors on a Unix socket (at app start, closed by close())."""
        if self.storage.kind == "memfd" and self.ipc_socket is None:
            fds, keys = self.storage.shared_fds()
            parent = self.settings.ipc_socket_dir or None
            self.ipc_socket = FdServer(fds, keys, self.instance_id, authorize, parent)

    def ipc_description(self) -> dict[str, Any]:
        """GET /v1/ipc: the storage's exports, the instance, and for memfd pools the socket to ask."""
        description = {**self.storage.ipc_description(), "instance_id": self.instance_id}
        if self.ipc_socket is not None:
            description["socket"] = self.ipc_socket.path
        return description

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
        if self.ipc_socket is not None:
            self.ipc_socket.close()
            self.ipc_socket = None
        self.engine.close()
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
