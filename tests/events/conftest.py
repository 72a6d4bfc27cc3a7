"""A real ZeroMQ subscriber for the KV events of a real `kvpool serve`, decoding with vLLM's own
classes where vLLM is installed (CI), else with kvpool's declaration of the same structs."""

import time
from typing import Any

import msgspec
import pytest
import zmq

try:  # vLLM's classes: what a router built on vLLM's wire format decodes with
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    DECODER = "vllm"
except ImportError:
    from service.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch  # type: ignore[assignment]

    DECODER = "kvpool"

from service.cli import free_port
from service.core.hashing import page_hash, root_hash, token_bytes
from tests.conftest import Server

__all__ = ["DECODER", "AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEventBatch"]
TOPIC = "kv@pod-0@test-model"


def events_env(**extra: str) -> dict[str, str]:
    return {
        "KVPOOL_KV_EVENTS_ENDPOINT": f"tcp://*:{free_port()}",
        "KVPOOL_KV_EVENTS_REPLAY_ENDPOINT": f"tcp://*:{free_port()}",
        "KVPOOL_KV_EVENTS_TOPIC": TOPIC,
        **extra,
    }


def local(endpoint: str) -> str:
    return endpoint.replace("*", "127.0.0.1")


class Subscriber:
    """SUB on the server's PUB endpoint: (seq, batch) pairs, decoded as vLLM's KVEventBatch."""

    def __init__(self, env: dict[str, str], topic: str = TOPIC) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(local(env["KVPOOL_KV_EVENTS_ENDPOINT"]))
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.topic = topic.encode()
        self.replay_endpoint = local(env.get("KVPOOL_KV_EVENTS_REPLAY_ENDPOINT", ""))
        time.sleep(0.5)  # a SUB's subscription reaches the PUB socket asynchronously ("slow joiner")

    def batches(self, timeout: float = 1.0) -> list[tuple[int, Any]]:
        """Every batch that arrives until none has for `timeout` seconds."""
        out = []
        while self.sub.poll(int(timeout * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.topic and len(seq) == 8
            out.append((int.from_bytes(seq, "big"), self.decoder.decode(payload)))
        return out

    def events(self, timeout: float = 1.0) -> list[Any]:
        return [e for _, batch in self.batches(timeout) for e in batch.events]

    def replay(self, start: int) -> list[tuple[int, Any]]:
        """Ask the ROUTER socket for the batches from `start` on, as vLLM's replay protocol does."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        try:
            while True:
                assert dealer.poll(5000), "no replay answer"
                empty, topic, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if seq == (-1).to_bytes(8, "big", signed=True):
                    assert topic == b"" and payload == b""
                    return out
                assert topic == self.topic
                out.append((int.from_bytes(seq, "big"), self.decoder.decode(payload)))
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


@pytest.fixture
def subscribe() -> Any:
    subscribers: list[Subscriber] = []

    def make(env: dict[str, str], topic: str = TOPIC) -> Subscriber:
        subscribers.append(Subscriber(env, topic))
        return subscribers[-1]

    yield make
    for s in subscribers:
        s.close()


def as_int(h: bytes) -> int:
    """A hash in vLLM's integer form (vllm.v1.core.kv_cache_utils.maybe_convert_block_hash)."""
    return int.from_bytes(h, "big") & (2**64 - 1)


def chain(tokens: list[int], page_size: int, tenant: str = "", hash_format: str = "int") -> list[Any]:
    """kvpool's hashes of the full pages of `tokens` (service.core.hashing), from the tenant's root, as
    the events publish them: in vLLM's integer form (the default), or as the 32 bytes."""
    parent = root_hash(tenant)
    out: list[Any] = []
    for i in range(len(tokens) // page_size):
        parent = page_hash(parent, token_bytes(tokens[i * page_size : (i + 1) * page_size]))
        out.append(as_int(parent) if hash_format == "int" else parent)
    return out


def put_prompt(server: Server, tokens: list[int], headers: dict[str, str] | None = None) -> dict[str, Any]:
    """Create a sequence on `tokens` (taking what is cached), append the rest with their ids, free it:
    its full pages are committed to the prefix cache. Returns the create's answer."""
    c = server.client
    created = c.post("/v1/sequences", json={"token_ids": tokens}, headers=headers)
    assert created.status_code == 201, created.text
    body = created.json()
    rest = tokens[body["cached_tokens"] :]
    if rest:
        append = {"num_tokens": len(rest), "token_ids": rest}
        r = c.post(f"/v1/sequences/{body['seq_id']}/append", json=append, headers=headers)
        assert r.status_code == 200, r.text
    assert c.delete(f"/v1/sequences/{body['seq_id']}", headers=headers).status_code == 200
    result: dict[str, Any] = body
    return result


def block_stored(hashes: list[Any], parent: Any, tokens: list[int], medium: str, page_size: int, tag: str) -> Any:
    """The BlockStored kvpool publishes for one run of pages: a chain start (parent None) carries the
    tenant tag in its first extra_keys entry, every other entry is None."""
    extra: list[Any] = [None] * len(hashes)
    if parent is None:
        extra[0] = (tag,)
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=page_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
        extra_keys=extra,
        group_idx=0,
    )
