"""Everything one pool owns, built from its Settings: the pool tensor, the allocator and sequences, the
engine, the KV events, the prefix cache with its tiers. create_app() builds one per app; tools and
benchmarks build one in process. Nothing here knows HTTP (service/server/state.py reaches it from routes).

Build order: storage, allocator, sequences, engine, events (the tiers publish to them), tiers, cache;
a failure on the way gives back what was built (threads, the pool). The tiers are built here, from
the settings, each given what it uses (service/tiers/ reads no settings).
"""

import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from service.config import Settings
from service.core.allocator import PageAllocator
from service.core.sequences import Sequence, SequenceTable
from service.engine.engine import DeviceEngine
from service.engine.storage import Storage
from service.ipc.fd_socket import FdServer
from service.tiers.cache import PrefixCache
from service.tiers.disk import DiskTier
from service.tiers.entries import EntryFormat, seal_for
from service.tiers.pages import PageCodec
from service.tiers.remote import RemoteStore
from service.tiers.remote_tier import RemoteTier
from service.tiers.spill import HostTier
from service.tiers.tier import Tier, TierEvents

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
        self.engine = DeviceEngine(self.storage, settings.attention_backend)
        self.ipc_socket: FdServer | None = None  # memfd pools: where frontends get the descriptors
        self.max_attend_tokens = settings.max_attend_tokens or default_max_attend_tokens(self.storage.device.type)
        self.events: EventPublisher | None = None
        tiers: list[Tier] = []
        try:
            if events_on:
                self.events = start_events(self)
            if tiers_on:
                tiers = build_tiers(settings, self.storage, self.engine, self.allocator, self.instance_id, self.events)
        except BaseException:  # e.g. the events port is taken: give back what is built (threads, the pool)
            if self.events is not None:
                self.events.close()
            self.engine.close()
            self.storage.close()
            raise
        self.cache = PrefixCache(self.allocator, self.sequences.prefixes.match, settings.page_size, tiers)
        self.ready = True

    async def create_sequence(
        self,
        seq_id: str | None,
        token_ids: list[int] | None,
        tenant: str,
        ttl_s: float,
        cache_salt: str,
        reserve_to: int | None = None,
    ) -> Sequence:
        """POST /v1/sequences: the pages of the prompt the device lost back from the tiers, then the
        core's create (and its reservation), with no await in between (so it finds every restored page in
        the device's index)."""
        if token_ids:
            await self.cache.restore(token_ids, tenant, cache_salt)
        return self.sequences.create(seq_id, token_ids, tenant, ttl_s, cache_salt, reserve_to)

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

    def close(self) -> None:
        self.ready = False
        if self.events is not None:
            self.events.close()
        if self.ipc_socket is not None:
            self.ipc_socket.close()
            self.ipc_socket = None
        self.cache.stop()
        self.engine.close()
        self.cache.close()
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


def build_tiers(
    s: Settings,
    storage: Storage,
    engine: DeviceEngine,
    allocator: PageAllocator,
    instance_id: str,
    publisher: "EventPublisher | None",
) -> list[Tier]:
    """The tiers below the device, in the order a restore asks them: the spill tier (KVPOOL_SPILL),
    then the remote one (KVPOOL_REMOTE_URL)."""
    codec = PageCodec(storage)
    events: TierEvents | None = None
    if publisher is not None:  # the spill tier publishes what it stores and drops (the remote one nothing:
        from service.events.listener import EventListener  # it is shared, no node can say what it holds)

        events = EventListener(publisher.put)
    tiers: list[Tier] = []
    try:
        if s.spill == "host":
            tiers.append(HostTier(codec, engine, s.spill_bytes, events))
        elif s.spill == "disk":
            tiers.append(DiskTier(codec, engine, s.spill_bytes, events, s.spill_path, instance_id))
        if s.remote_url:
            entries = EntryFormat(s.geometry_tag, seal_for(s.remote_secret.get_secret_value()))
            store = RemoteStore(s.remote_url, s.remote_timeout_s, s.remote_ttl_s, entries, codec.page_nbytes)
            tiers.append(RemoteTier(store, engine, codec, allocator.page_name, s.remote_queue_pages))
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers
