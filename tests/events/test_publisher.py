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


def wakeups(thread: threading.Thread) -> int:
    """How often the kernel has switched `thread` out and back in (voluntary: it slept)."""
    status = Path(f"/proc/self/task/{thread.native_id}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("voluntary_ctxt_switches")))


@pytest.mark.parametrize("with_replay", [False, True], ids=["publish-only", "with-replay"])
def test_an_idle_publisher_sleeps_until_an_item_or_a_replay_request(tmp_path: Path, with_replay: bool) -> None:
    """No periodic wake-ups while idle (each one waits for a core on a loaded node), and an item or a replay
    request put while it sleeps goes out at once."""
    endpoint, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay" if with_replay else ""
    pub = EventPublisher(lambda item: BlockRemoved(block_hashes=[item], medium="CPU"), endpoint, replay)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        time.sleep(0.3)
        before = wakeups(pub._thread)
        time.sleep(1.0)
        assert wakeups(pub._thread) - before <= 2  # (it polled every 20 ms before: ~50)
        for item in (7, 8):
            start = time.monotonic()
            pub.put(item)
            assert sub.poll(2000), "the item was not published"
            decoded = msgspec.msgpack.Decoder(KVEventBatch).decode(sub.recv_multipart()[2])
            assert decoded.events[0].block_hashes == [item] and time.monotonic() - start < 0.5
            time.sleep(0.2)  # asleep again before the next one
        if with_replay:
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(replay)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])  # replay from batch 0, while the thread sleeps
            frames = [dealer.recv_multipart() for _ in range(3)]  # (each recv waits for its frame)
            assert [f[2] for f in frames] == [(0).to_bytes(8, "big"), (1).to_bytes(8, "big"), END_SEQ]
            dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        ctx.term()
        pub.close()
    assert not pub._thread.is_alive()
