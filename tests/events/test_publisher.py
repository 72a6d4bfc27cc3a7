"""The publisher alone, in process: a full queue drops and counts without waiting, and the first
batch after a drop skips a sequence number; replay and shutdown."""

import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from service.events.publisher import END_SEQ, EventPublisher, is_bind_endpoint
from service.events.wire import BlockRemoved, KVEventBatch


def test_bind_or_connect_as_vllm() -> None:
    assert is_bind_endpoint("tcp://*:5557") and is_bind_endpoint("tcp://[::]:5557")
    assert is_bind_endpoint("ipc:///tmp/x") and is_bind_endpoint("inproc://x")
    assert not is_bind_endpoint("tcp://router.example:5557")


def test_full_queue_drops_without_blocking_and_leaves_a_gap(tmp_path: Path) -> None:
    entered, release = threading.Event(), threading.Event()

    def make_event(item: Any) -> BlockRemoved:
        if item == 0:  # the thread stalls on the first event until the test lets it go
            entered.set()
            release.wait(10)
        return BlockRemoved(block_hashes=[item], medium="CPU")

    endpoint, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    pub = EventPublisher(make_event, endpoint, replay, topic="t", queue_size=2)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.3)
    try:
        pub.put(0)
        assert entered.wait(5)  # the thread holds a batch of exactly that one event
        start = time.perf_counter()
        for i in range(1, 11):
            pub.put(i)
        took = time.perf_counter() - start
        assert pub.dropped == 8 and took < 0.05  # 2 fit; the others are dropped at once
        release.set()
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        got = []
        while len(got) < 2 and sub.poll(5000):
            topic, seq, payload = sub.recv_multipart()
            got.append((topic, int.from_bytes(seq, "big"), [e.block_hashes[0] for e in decoder.decode(payload).events]))
        # Batch 0 holds the stalled event; number 1 stands for what was dropped; 2 holds what fitted.
        assert got == [(b"t", 0, [0]), (b"t", 2, [1, 2])]
        deadline = time.monotonic() + 5
        while pub.batches < 2 and time.monotonic() < deadline:  # counted just after the send
            time.sleep(0.01)
        assert (pub.published, pub.batches, pub.dropped) == (3, 2, 8)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay)
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        frames = [dealer.recv_multipart() for _ in range(2)]
        assert frames[0][:3] == [b"", b"t", (2).to_bytes(8, "big")]
        assert frames[1] == [b"", b"", END_SEQ, b""]
        dealer.close(linger=0)
    finally:
        release.set()
        sub.close(linger=0)
        ctx.term()
        pub.close()
    assert not pub._thread.is_alive()


def test_close_publishes_what_is_queued(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/pub"
    pub = EventPublisher(lambda i: BlockRemoved(block_hashes=[i], medium=None), endpoint)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.3)
    for i in range(5):
        pub.put(i)
    pub.close()
    assert pub.published == 5 and pub.dropped == 0
    events = []
    while sub.poll(1000):
        events += msgspec.msgpack.Decoder(KVEventBatch).decode(sub.recv_multipart()[2]).events
    assert [e.block_hashes for e in events] == [[i] for i in range(5)]
    sub.close(linger=0)
    ctx.term()


def test_a_taken_port_stops_the_server_at_start(start_server: Any) -> None:
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://*")
    try:
        with pytest.raises(RuntimeError, match=f"KV events: cannot open tcp://\\*:{port}.*Address already in use"):
            start_server({"KVPOOL_KV_EVENTS_ENDPOINT": f"tcp://*:{port}"})
    finally:
        taken.close(linger=0)
        ctx.term()
