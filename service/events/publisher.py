"""The publisher: a bounded queue, one thread, a ZeroMQ PUB socket and a replay ROUTER socket.

The wire protocol is vLLM's `ZmqEventPublisher` (vllm/distributed/kv_events.py, 0.32):
  - PUB: each batch is the multipart message [topic, sequence number (8 bytes, big-endian), payload],
    payload = msgpack of an EventBatch; the endpoint is bound when it has a wildcard (`tcp://*:5557`,
    `::`) or is ipc:// or inproc://, and connected to otherwise;
  - ROUTER (replay): vLLM's protocol, served by replay.py so that no batch is lost unseen; the
    buffer keeps the newest `buffer_batches` batches within `buffer_bytes` bytes of payload.

What differs, on purpose: the request path never waits. put() is called on the event loop (by the
listener) and only appends a small tuple to the queue (and wakes the thread if it sleeps); when the
queue is full the item is dropped and counted, never the request. The thread turns queued items into
events (`make_event`) and sends everything waiting as one batch. Idle, it sleeps until an item or a
replay request comes (a wake-up pipe and the ROUTER socket, polled together): no periodic wake-ups, which
on a machine whose cores the engines keep busy each wait for a core (docs/fleet.md).
Sequence numbers count batches from 0 with no gaps, except that
the first batch after a drop skips one number: a subscriber that sees the gap knows events were lost
(a replay cannot return them: they were never published) and should rebuild what it holds.
"""

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from service.events.replay import END_SEQ, ReplayBuffer, ReplayServer
from service.events.wire import EventBatch, KVCacheEvent

log = logging.getLogger("kvpool.events")

__all__ = ["END_SEQ", "EventPublisher", "is_bind_endpoint"]
MAX_BATCH = 1024  # events per batch at most (a burst becomes several batches)
STALLED_S = 0.005  # how long it waits while replies are in progress but their readers' queues are full
ERROR_PAUSE_S = 0.02  # after a batch that failed to publish, or a replay turn that failed


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class EventPublisher:
    def __init__(
        self,
        make_event: Callable[[Any], KVCacheEvent | list[KVCacheEvent]],
        endpoint: str,
        replay_endpoint: str = "",
        topic: str = "",
        buffer_batches: int = 10_000,
        buffer_bytes: int = 64 << 20,
        queue_size: int = 100_000,
        hwm: int = 100_000,
    ) -> None:
        self._make_event = make_event
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._buffer = ReplayBuffer(buffer_batches, buffer_bytes)
        self._topic = topic.encode()
        self.published = 0  # events sent (written by the thread only)
        self.batches = 0
        self.dropped = 0  # events dropped because the queue was full (written by put() only)
        self._dropped_seen = 0
        self._next_seq = 0
        self._wake_r, self._wake_w = os.pipe()  # a byte written by put() or close() while the thread sleeps
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: ReplayServer | None = None
        try:
            self._pub.set_hwm(hwm)  # past it, a slow subscriber loses messages; PUB never blocks
            if is_bind_endpoint(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint:
                router = self._ctx.socket(zmq.ROUTER)
                self._replay = ReplayServer(router, self._buffer, self._topic)
                router.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise RuntimeError(f"KV events: cannot open {endpoint} / {replay_endpoint or '-'}: {exc}") from exc
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.socket.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else ""
        log.info("KV events on %s (replay: %s), topic %r", self.endpoint, self.replay_endpoint or "none", topic)
        self._running = True
        self._sleeping = False
        self._thread = threading.Thread(target=self._run, name="kvpool-kv-events", daemon=True)
        self._thread.start()

    def put(self, item: Any) -> None:
        """Queue `item` for the thread; never blocks: a full queue drops it (counted)."""
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            return
        if self._sleeping:  # (read after the put: a thread about to sleep sees the item, or gets the wake-up)
            self._wake_up()

    def _wake_up(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    def replay_outcomes(self) -> dict[str, int]:
        """How replay requests ended so far ({} without a replay socket); read from any thread."""
        return self._replay.outcomes() if self._replay is not None else {}

    def close(self, timeout: float = 1.0) -> None:
        """Publish what is queued (for up to `timeout` seconds), then stop the thread and close."""
        self._running = False
        self._wake_up()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("KV events: the publisher thread did not stop in %.1f s", timeout)
            return  # the daemon thread still uses the sockets: leave them to the process exit
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay.socket if self._replay else None):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay.socket, zmq.POLLIN)
        deadline = None
        while True:
            if not self._running:
                deadline = deadline or time.monotonic() + 1.0
                if self._queue.empty() or time.monotonic() > deadline:
                    return
            sent = stalled = False
            if self._replay is not None:
                try:
                    sent = self._replay.turn()
                    stalled = bool(self._replay.replies)
                except Exception:  # a bad request must not stop publishing
                    log.exception("KV events: serving replay failed")
                    time.sleep(ERROR_PAUSE_S)  # (not at once again: the request may still be waiting)
            try:
                items = [self._queue.get_nowait()]
            except queue.Empty:
                if not sent:
                    self._sleep(poller, STALLED_S if stalled else None)
                continue
            while len(items) < MAX_BATCH:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._publish(encoder, items)
            except Exception:
                log.exception("KV events: publishing a batch failed")
                time.sleep(ERROR_PAUSE_S)

    def _sleep(self, poller: zmq.Poller, timeout_s: float | None) -> None:
        """Until put() or close() writes the wake-up pipe, a replay request arrives, or `timeout_s` passes."""
        self._sleeping = True
        try:
            if self._queue.empty() and self._running:
                poller.poll(None if timeout_s is None else max(1, round(timeout_s * 1000)))
        finally:
            self._sleeping = False
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass

    def _publish(self, encoder: msgspec.msgpack.Encoder, items: list[Any]) -> None:
        dropped = self.dropped
        if dropped != self._dropped_seen:  # events were lost since the last batch: leave a gap
            self._dropped_seen = dropped
            self._next_seq += 1
        events: list[KVCacheEvent] = []
        for item in items:
            made = self._make_event(item)
            events.extend(made) if isinstance(made, list) else events.append(made)
        batch = EventBatch(ts=time.time(), events=events, data_parallel_rank=0)
        payload = encoder.encode(batch)
        seq = self._next_seq
        self._next_seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append(seq, payload)
        self.published += len(events)
        self.batches += 1
