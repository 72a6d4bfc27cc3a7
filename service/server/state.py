"""Everything one app owns, built once by create_app(), reached through dependency aliases."""

import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import orjson
from fastapi import Depends, Request
from starlette.responses import Response

from service.config import Settings
from service.core.allocator import PageAllocator
from service.core.sequences import Sequence, SequenceTable
from service.engine.engine import Engine
from service.engine.storage import Storage
from service.ipc.fd_socket import FdServer
from service.tiers.manager import Tiers

if TYPE_CHECKING:
    from service.events.publisher import EventPublisher


class PoolState:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.instance_id = uuid.uuid4().hex
        self.storage = Storage(settings, self.instance_id)
        events_on, tiers_on = bool(settings.kv_events_endpoint), settings.spill != "none" or bool(settings.remote_url)
        # KV events and the tiers name pages by their chained SHA-256 hash; without them, serial names
        # spare every miss its hashing (service/core/prefix_index.py).
        self.allocator = PageAllocator(settings.num_pages, settings.enable_prefix_caching, events_on or tiers_on)
        self.sequences = SequenceTable(self.allocator, settings.page_size, settings.tenant_max_pages)
        self.engine = Engine(self.storage, settings.attention_backend)
        self.ipc_socket: FdServer | None = None  # memfd pools: where frontends get the descriptors
        self.max_attend_tokens = settings.max_attend_tokens or default_max_attend_tokens(self.storage.device.type)
        self.events: EventPublisher | None = None
        self.tiers: Tiers | None = None
        try:
            if events_on:
                self.events = start_events(self)
            if tiers_on:
                self.tiers = Tiers(self)
        except BaseException:  # e.g. the events port is taken: give back what is built (threads, the pool)
            if self.events is not None:
                self.events.close()
            self.engine.close()
            self.storage.close()
            raise
        if self.tiers is not None and self.events is not None:  # the node's tier publishes what it stores and drops
            from service.events.listener import EventListener

            self.tiers.events = EventListener(self.events.put)
        self.ready = True

    def open_ipc_socket(self, authorize: Callable[[str | None], None]) -> None:
        """memfd pools: serve the descriptors on a Unix socket (at app start, closed by close())."""
        if self.storage.kind == "memfd" and self.ipc_socket is None:
            fds, keys = self.storage.shared_fds()
            parent = self.settings.ipc_socket_dir or None
            # The whole request line within the HTTP head's deadline (it is this socket's head).
            line_timeout_s = self.settings.request_head_timeout_s
            self.ipc_socket = FdServer(fds, keys, self.instance_id, authorize, parent, line_timeout_s=line_timeout_s)

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
        if self.events is not None:
            self.events.close()
        if self.ipc_socket is not None:
            self.ipc_socket.close()
            self.ipc_socket = None
        if self.tiers is not None:
            self.tiers.stop()
        self.engine.close()
        if self.tiers is not None:
            self.tiers.close()
        self.storage.close()


def default_max_attend_tokens(device_type: str) -> int:
    """KVPOOL_MAX_ATTEND_TOKENS when it is 0: what each device finishes in seconds. The one device
    worker runs every tenant's attention in turn, so one attend's size is every tenant's wait.

    CPU, 2**22 (a 2,048-token prompt prefilled in one call): measured through `kvpool serve` on a
    2-core machine, 2.1 s with Llama-3-8B's heads (32 query heads of 128 channels, 8 KV heads); 2**24
    took 9-12 s with those heads (0.8-1.9 s with 16 query heads of 64 channels).
    CUDA, 2**36 (a 262,144-token prompt in one call): about 10^15 flops with those heads, seconds on
    an H100. An engine's chunked prefill (chunks of 2-16k tokens over contexts up to 128k: 2**30 at
    most) and its decode batches stay far below it.
    """
    return 2**36 if device_type == "cuda" else 2**22


def start_events(state: PoolState) -> "EventPublisher":
    """The KV event publisher of KVPOOL_KV_EVENTS_* (zmq and msgspec are imported only when it is on)."""
    from service.events.listener import start_publishing
    from service.events.wire import MEDIUM_GPU

    s = state.settings
    return start_publishing(
        state.allocator,
        s.page_size,
        MEDIUM_GPU,  # the pool is the engine's own cache on any device (see service/events/wire.py)
        s.kv_events_endpoint,
        s.kv_events_replay_endpoint,
        s.kv_events_topic,
        s.kv_events_buffer,
        s.kv_events_buffer_bytes,
        s.kv_events_queue,
        s.kv_events_hash_format,
    )


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
