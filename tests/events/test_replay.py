"""Replay, in process against a real publisher over loopback TCP: every buffered batch from start_seq,
in order, then the end marker (vLLM's protocol), for a reader as fast as it can go and for many
concurrent readers; a reply cut short says where it stopped; the buffer is bounded in bytes."""

import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from service.events.publisher import END_SEQ, EventPublisher
from service.events.wire import BlockRemoved, KVEventBatch

DECODE = msgspec.msgpack.Decoder(KVEventBatch)


def removed(item: tuple[int, int]) -> BlockRemoved:
    """Item (i, n) -> an event of n hashes derived from i (a batch's payload grows with n)."""
    i, n = item
    return BlockRemoved(block_hashes=[(i * 7919 + j) * 2654435761 % 2**64 for j in range(n)], medium="GPU")


@pytest.fixture
def publisher() -> Iterator[Any]:
    made: list[EventPublisher] = []

    def make(**kwargs: Any) -> EventPublisher:
        made.append(EventPublisher(removed, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="t", **kwargs))
        return made[-1]

    yield make
    for pub in made:
        pub.close()


def publish(pub: EventPublisher, num_batches: int, hashes: int = 32) -> None:
    """`num_batches` batches of one event each: the next item is put once the last is published."""
    first = pub.batches
    for i in range(num_batches):
        pub.put((first + i, hashes))
        deadline = time.monotonic() + 5
        while pub.batches <= first + i:
            assert time.monotonic() < deadline, "the publisher thread stalled"
            time.sleep(0.0002)


def outcomes(pub: EventPublisher, **expected: int) -> dict[str, int]:
    """The publisher's replay outcomes once they show `expected` (each is counted just after its
    reply's last message went out), or after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        got = pub.replay_outcomes()
        if all(got[k] == v for k, v in expected.items()) or time.monotonic() > deadline:
            return got
        time.sleep(0.01)


def ask(ctx: zmq.Context[Any], endpoint: str, start: int, small_queues: bool = False) -> zmq.Socket[Any]:
    """A DEALER that has sent a replay request; `small_queues`: it holds little it has not read (8
    messages in ZeroMQ's queue, 64 KiB in the kernel's), so that a reply outgrows it at once."""
    dealer = ctx.socket(zmq.DEALER)
    if small_queues:
        dealer.setsockopt(zmq.RCVHWM, 8)
        dealer.setsockopt(zmq.RCVBUF, 1 << 16)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    return dealer


def read_reply(dealer: zmq.Socket[Any], timeout_s: float = 10.0) -> list[int]:
    """The sequence numbers of one reply, read as fast as possible, up to the end marker."""
    seqs: list[int] = []
    while True:
        assert dealer.poll(int(timeout_s * 1000)), f"no end marker after {len(seqs)} batches"
        empty, topic, seq, payload = dealer.recv_multipart()
        if seq == END_SEQ:
            assert (empty, topic, payload) == (b"", b"", b"")
            return seqs
        assert (empty, topic) == (b"", b"t")
        seqs.append(int.from_bytes(seq, "big"))
        event = DECODE.decode(payload).events[0]
        assert isinstance(event, BlockRemoved) and event.block_hashes[0] == removed((seqs[-1], 1)).block_hashes[0]


def test_one_fast_reader_gets_every_buffered_batch_in_order(publisher: Any) -> None:
    pub = publisher(buffer_batches=4000)
    publish(pub, 3000, hashes=64)
    ctx = zmq.Context()
    try:
        start = time.perf_counter()
        for start_seq in (0, 1234):
            dealer = ask(ctx, pub.replay_endpoint, start_seq)
            seqs = read_reply(dealer)
            dealer.close(linger=0)
            assert seqs == list(range(start_seq, 3000)), f"{len(seqs)} batches, first {seqs[:1]}, last {seqs[-1:]}"
        print(f"3,000 buffered, 3,000 + 1,766 replayed in {time.perf_counter() - start:.2f} s")
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize(("num_readers", "num_batches"), [(20, 2000), (200, 600)])
def test_many_concurrent_replays_all_complete(publisher: Any, num_readers: int, num_batches: int) -> None:
    pub = publisher()
    publish(pub, num_batches)
    ctx = zmq.Context()
    try:
        start = time.perf_counter()
        dealers = [ask(ctx, pub.replay_endpoint, 0) for _ in range(num_readers)]
        got: dict[zmq.Socket[Any], list[int]] = {d: [] for d in dealers}
        done: set[zmq.Socket[Any]] = set()
        poller = zmq.Poller()
        for d in dealers:
            poller.register(d, zmq.POLLIN)
        deadline = time.monotonic() + 120
        while len(done) < num_readers and time.monotonic() < deadline:
            for d, _ in poller.poll(1000):
                while d.poll(0):
                    _, _, seq, _ = d.recv_multipart()
                    if seq == END_SEQ:
                        done.add(d)
                        poller.unregister(d)
                        break
                    got[d].append(int.from_bytes(seq, "big"))
        took = time.perf_counter() - start
        print(f"{num_batches} buffered, {num_readers} concurrent replays: {len(done)} complete in {took:.1f} s")
        assert len(done) == num_readers
        assert all(seqs == list(range(num_batches)) for seqs in got.values())
    finally:
        ctx.destroy(linger=0)


def test_the_buffer_is_bounded_in_bytes_and_the_reply_shows_what_was_lost(publisher: Any) -> None:
    pub = publisher(buffer_batches=10_000, buffer_bytes=20_000)
    publish(pub, 200, hashes=32)  # ~300 bytes of payload each
    ctx = zmq.Context()
    try:
        dealer = ask(ctx, pub.replay_endpoint, 0)
        seqs, size = [], 0
        while True:
            assert dealer.poll(5000)
            _, _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            seqs.append(int.from_bytes(seq, "big"))
            size += len(payload)
        # The newest batches that fit, consecutive: a reader asking from 0 sees where its reply starts.
        assert 20_000 - 400 < size <= 20_000 and seqs == list(range(200 - len(seqs), 200)) and seqs[0] > 0
    finally:
        ctx.destroy(linger=0)


def test_a_reply_outrun_by_the_buffer_stops_where_its_batches_left_and_says_so(publisher: Any) -> None:
    pub = publisher(buffer_batches=1000)
    publish(pub, 1000, hashes=1000)  # ~9 KB each: the reply is far more than the sockets can hold
    ctx = zmq.Context()
    try:
        dealer = ask(ctx, pub.replay_endpoint, 0, small_queues=True)
        time.sleep(0.3)  # the reader takes nothing while the buffer turns over
        publish(pub, 1000, hashes=1000)
        seqs = read_reply(dealer)
        # Consecutive from 0, then the end marker: the reader knows it stopped at seqs[-1].
        assert seqs == list(range(len(seqs))) and 0 < len(seqs) < 1000
        dealer.send_multipart([b"", (seqs[-1] + 1).to_bytes(8, "big")])
        again = read_reply(dealer)
        assert again == list(range(1000, 2000))  # what is buffered now: the gap before it is visible
        assert outcomes(pub, cut_short=1, completed=1) == {"completed": 1, "cut_short": 1, "abandoned": 0, "refused": 0}
        dealer.close(linger=0)
    finally:
        ctx.destroy(linger=0)


def test_malformed_and_repeated_requests(publisher: Any) -> None:
    pub = publisher()
    publish(pub, 50)
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([(0).to_bytes(8, "big")])  # no empty frame
        dealer.send_multipart([b"", b"x", b"y"])
        oversized = ctx.socket(zmq.DEALER)
        oversized.connect(pub.replay_endpoint)
        oversized.send_multipart([b"", bytes(1000)])  # past the frame limit: disconnected, never answered
        for start in (40, 10, 45):  # three requests before reading: three replies, in order
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
        assert [read_reply(dealer) for _ in range(3)] == [list(range(s, 50)) for s in (40, 10, 45)]
        assert outcomes(pub, completed=3) == {"completed": 3, "cut_short": 0, "abandoned": 0, "refused": 2}
        assert not oversized.poll(500)
        dealer.close(linger=0)
        oversized.close(linger=0)
    finally:
        ctx.destroy(linger=0)


def test_a_reader_that_takes_nothing_is_abandoned_and_delays_nobody(publisher: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr("service.events.replay.STALL_S", 0.5)
    pub = publisher()
    publish(pub, 1000, hashes=1000)
    ctx = zmq.Context()
    try:
        stalled = ask(ctx, pub.replay_endpoint, 0, small_queues=True)
        reader = ask(ctx, pub.replay_endpoint, 900)
        assert read_reply(reader) == list(range(900, 1000))
        assert outcomes(pub, abandoned=1) == {"completed": 1, "cut_short": 0, "abandoned": 1, "refused": 0}
        stalled.close(linger=0)
        reader.close(linger=0)
    finally:
        ctx.destroy(linger=0)
