"""The remote tier on a Redis (or Valkey) Cluster: the URL, the write client and the read routing.

URL: redis+cluster://[user:password@]host:port[,host:port...][/0], or rediss+cluster:// for TLS (with
redis-py's ssl_* options of service.remote_url.TLS_OPTIONS as the query, as on rediss://). The hosts are
seeds: any one that answers gives the whole slot map. A scheme of its own, as Prefect and docket name
Sentinel (redis+sentinel://), because a cluster is a different protocol from the same redis:// port (a
standalone client there gets -MOVED for two keys in three), the whole topology then fits the one
variable compose and Kubernetes already pass (KVPOOL_REMOTE_URL), and a seed list keeps working with
one seed down. A cluster has only database 0.

Writes: redis-py's RedisCluster (its pipelines send each node its SETs in one round trip), created
at the first write so a cluster down at start-up only counts errors. Reads: ClusterReader routes each
key to the primary that owns its slot (redis.crc.key_slot over the slot map from CLUSTER SLOTS) and
pipelines one GETEX (or EXISTS) per key to each node (service.tiers.resp), so a batch of keys is one write per
node and its replies are read in key order. No hash tags: a tag per tenant or geometry would put that
tenant's whole cache on one node, a tag per prefix chain every prefix behind a shared system prompt on
one node; without one the pages of a prefix spread over every node and their reads run in parallel.
A -MOVED/-ASK answer (a resharding, a failover) is not loaded: the lookup stops short there, the
redirect is counted as an error and the slot map is fetched again before the next batch; a node that
fails closes every connection and the map is fetched again too.
"""

import collections
from collections.abc import Callable, Sequence
from typing import Any

from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.retry import Retry

from service.remote_url import Address, parse_cluster_url
from service.tiers.resp import REDIRECTED, RespConnection, RespError, tls_context


def cluster_client(url: str, timeout: float) -> RedisCluster:
    """A RedisCluster for writes (and rediss+cluster:// reads): no retries, each command bounded by
    timeout. Connects at once (raises if no seed answers)."""
    seeds, username, password, tls = parse_cluster_url(url)
    return RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in seeds],
        username=username,
        password=password,
        ssl=tls is not None,
        **(tls or {}),
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
    )


class ClusterReader:
    """RespConnection's send_keyed / send_getex / read_value / read_int over a cluster: keys routed to
    the primary of their slot, one connection per node, replies read back in the order the keys were sent."""

    def __init__(self, url: str, timeout: float) -> None:
        self.seeds, self.username, self.password, tls = parse_cluster_url(url)
        self.tls = tls_context(tls) if tls is not None else None
        self.timeout = timeout
        self.nodes: dict[Address, RespConnection] = {}
        self.slots: list[Address | None] | None = None  # owner of each slot; None: fetch before sending
        self._order: collections.deque[Address] = collections.deque()  # the node of each reply to come

    def _node(self, address: Address) -> RespConnection:
        conn = self.nodes.get(address)
        if conn is None:
            conn = RespConnection(
                address[0],
                address[1],
                username=self.username,
                password=self.password,
                tls=self.tls,
                timeout=self.timeout,
            )
            self.nodes[address] = conn
        return conn

    def refresh(self) -> None:
        """The slot map from the first node (known ones, then the seeds) that answers CLUSTER SLOTS."""
        error: BaseException = RespError("no Redis Cluster seed")
        for address in [*self.nodes, *(s for s in self.seeds if s not in self.nodes)]:
            try:
                reply: Any = self._node(address).command(b"CLUSTER", b"SLOTS")
            except (OSError, RespError) as exc:
                error = exc
                continue
            slots: list[Address | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
            for start, end, primary, *_replicas in reply:
                owner = (primary[0].decode() or address[0], int(primary[1]))  # "": the node asked
                slots[start : end + 1] = [owner] * (end + 1 - start)
            self.slots = slots
            return
        raise error

    def send_getex(self, keys: list[bytes], ttl_s: int) -> None:
        self.send_keyed(b"GETEX", keys, b"EX", str(ttl_s).encode())

    def send_keyed(self, command: bytes, keys: list[bytes], *tail: bytes) -> None:
        try:
            if self.slots is None:
                self.refresh()
            assert self.slots is not None
            groups: dict[Address, list[bytes]] = {}
            for key in keys:
                owner = self.slots[key_slot(key)]
                if owner is None:
                    raise RespError(f"slot {key_slot(key)} is served by no node")
                groups.setdefault(owner, []).append(key)
                self._order.append(owner)
            for owner, owned in groups.items():
                self._node(owner).send_keyed(command, owned, *tail)
        except BaseException:
            self.close()
            raise

    def read_value(self, into: Sequence[memoryview]) -> int:
        return self._read(lambda conn: conn.read_value(into))

    def read_int(self) -> int:
        return self._read(RespConnection.read_int)

    def _read(self, read: Callable[[RespConnection], int]) -> int:
        try:
            reply = read(self.nodes[self._order.popleft()])
        except BaseException:
            self.close()
            raise
        if reply == REDIRECTED:
            self.slots = None  # fetched again before the next send
        return reply

    def close(self) -> None:
        """Every connection closed, the replies still due forgotten, the slot map fetched again next time."""
        for conn in self.nodes.values():
            conn.close()
        self._order.clear()
        self.slots = None
