"""The replay buffer and the replay socket: vLLM's protocol, served so that no batch is lost unseen.

The protocol is vLLM's (`ZmqEventPublisher`, vllm/distributed/kv_events.py, 0.32): a DEALER sends
[b"", start sequence (8 bytes, big-endian)] to the ROUTER; the answer is one message [b"", topic,
seq, payload] per buffered batch with seq >= start, oldest first, then the end marker [b"", b"", -1
(8 bytes, signed), b""]. What differs, on purpose, from vLLM's server (which sends a whole reply in
one loop on its publisher thread, with ZeroMQ's default of silently dropping messages to a peer
whose queue is full: a hole in the middle of a reply, then the end marker):

  - the ROUTER is ZMQ_ROUTER_MANDATORY and sends without blocking: a peer whose queue is full
    (ZMQ_SNDHWM messages) is not dropped from, its reply waits and goes on on a later turn;
  - replies are served a few batches each per turn, round-robin, MAX_REPLIES at a time (further
    requests wait in ZeroMQ's queue until one ends): the publisher thread's turn stays short, and a
    slow reader delays nobody else;
  - a reply is the consecutive buffered batches from its start up to the newest batch at the time
    of the request (its work is bounded by the buffer's); it ends early, with the end marker, only
    when its next batch has left the buffer meanwhile (a reader slower than the buffer's turnover).
    So a reply never has a hole: the last seq before the end marker is where it stopped, and a
    consumer that needs more asks again from the next;
  - a reply whose reader takes nothing for STALL_S is abandoned (its queue is full: not even the
    end marker fits) and logged.

The buffer keeps the newest batches within both bounds, a number of batches and a number of
payload bytes (a batch alone larger than the byte bound is not kept).
"""

import bisect
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import zmq

log = logging.getLogger("kvpool.events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_REPLIES = 64  # replies in progress at once
SNDHWM = 16  # messages queued per replay peer (ZeroMQ copies payloads under 64 KiB into its queue)
CHUNK = 16  # batches sent to one reply per turn at most
MAX_REQUESTS_PER_TURN = 256
MAX_QUEUED_PER_PEER = 8  # further requests from a peer whose reply is in progress, kept for later
MAX_FRAME_BYTES = 64  # a request's frames are 0 and 8 bytes: a peer sending a larger one is disconnected
STALL_S = 30.0


class ReplayBuffer:
    """The newest published batches, (seq, payload), within `max_batches` and `max_bytes` of payload.

    Batches are addressed by position: the count of batches appended before them, which, unlike the
    deque's index, does not move when older batches leave."""

    def __init__(self, max_batches: int, max_bytes: int) -> None:
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self._batches: deque[tuple[int, bytes]] = deque()
        self.num_bytes = 0
        self.first = 0  # the position of the oldest batch kept

    def __len__(self) -> int:
        return len(self._batches)

    @property
    def end(self) -> int:
        """The position the next batch appended will have."""
        return self.first + len(self._batches)

    def append(self, seq: int, payload: bytes) -> None:
        self._batches.append((seq, payload))
        self.num_bytes += len(payload)
        while self._batches and (len(self._batches) > self.max_batches or self.num_bytes > self.max_bytes):
            self.num_bytes -= len(self._batches.popleft()[1])
            self.first += 1

    def position(self, seq: int) -> int:
        """The position of the oldest kept batch whose sequence number is >= `seq`."""
        return self.first + bisect.bisect_left(self._batches, seq, key=lambda batch: batch[0])

    def at(self, position: int) -> tuple[int, bytes] | None:
        """The batch at `position`, or None when it has left the buffer (or is not there yet)."""
        i = position - self.first
        return self._batches[i] if 0 <= i < len(self._batches) else None


@dataclass
class Reply:
    next: int  # position of the next batch to send
    end: int  # position after the last batch of this reply
    progress_at: float  # when the peer last took a message
    queued: deque[int] = field(default_factory=deque)  # start seqs of the peer's later requests


class ReplayServer:
    """The ROUTER socket and the replies in progress; used by the publisher thread only."""

    def __init__(self, socket: zmq.Socket[bytes], buffer: ReplayBuffer, topic: bytes) -> None:
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        socket.setsockopt(zmq.SNDHWM, SNDHWM)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self.socket = socket
        self.buffer = buffer
        self.topic = topic
        self.replies: dict[bytes, Reply] = {}
        self.completed = 0  # replies that reached their last batch
        self.cut_short = 0  # replies ended early: their next batch had left the buffer
        self.abandoned = 0  # replies dropped: the peer left, or took nothing for STALL_S
        self.refused = 0  # malformed requests, and requests past MAX_QUEUED_PER_PEER

    def outcomes(self) -> dict[str, int]:
        """How requests ended so far (what kvpool_kv_events_replays_total{outcome} reports)."""
        return {
            "completed": self.completed,
            "cut_short": self.cut_short,
            "abandoned": self.abandoned,
            "refused": self.refused,
        }

    def turn(self) -> bool:
        """Take waiting requests, then send each reply in progress its share. True when a message
        went out (the caller may turn again at once)."""
        self._take_requests()
        now, sent = time.monotonic(), False
        for peer in list(self.replies):
            reply = self.replies[peer]
            if self._send(peer, reply):
                reply.progress_at, sent = now, True
            elif peer in self.replies and now - reply.progress_at > STALL_S:
                log.warning("KV events: a replay reader took nothing for %.0f s; its reply is abandoned", STALL_S)
                self._finish(peer, completed=None)
        return sent

    def _take_requests(self) -> None:
        for _ in range(MAX_REQUESTS_PER_TURN):
            if len(self.replies) >= MAX_REPLIES or not self.socket.poll(0):
                return
            frames = self.socket.recv_multipart()
            if len(frames) != 3:
                self._refuse(f"a replay request of {len(frames)} frames (3 expected)")
                continue
            peer, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            reply = self.replies.get(peer)
            if reply is None:
                self.replies[peer] = self._reply(start)
            elif len(reply.queued) < MAX_QUEUED_PER_PEER:
                reply.queued.append(start)
            else:
                self._refuse(f"a replay peer sent more than {MAX_QUEUED_PER_PEER} requests unread")

    def _refuse(self, why: str) -> None:
        """Count a request ignored; log the first (the metric counts them all: no log flood)."""
        self.refused += 1
        (log.warning if self.refused == 1 else log.debug)("KV events: %s; ignored (%d so far)", why, self.refused)

    def _reply(self, start: int) -> Reply:
        return Reply(self.buffer.position(start), self.buffer.end, time.monotonic())

    def _send(self, peer: bytes, reply: Reply) -> bool:
        """Up to CHUNK batches of the reply, then its end marker when it is through; False when the
        peer's queue took nothing."""
        sent = False
        for _ in range(CHUNK):
            batch = self.buffer.at(reply.next) if reply.next < reply.end else None
            frames = (
                (peer, b"", b"", END_SEQ, b"")
                if batch is None
                else (peer, b"", self.topic, batch[0].to_bytes(8, "big"), batch[1])
            )
            try:
                self.socket.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:  # the peer's queue is full: go on next turn
                return sent
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                self._finish(peer, completed=None)  # the peer is gone
                return sent
            sent = True
            if batch is not None:
                reply.next += 1
                continue
            self._finish(peer, completed=reply.next >= reply.end)
            return sent
        return sent

    def _finish(self, peer: bytes, completed: bool | None) -> None:
        """Count how the peer's reply ended; start its next queued request, if any."""
        if completed is None:
            self.abandoned += 1
            del self.replies[peer]
            return
        if completed:
            self.completed += 1
        else:
            self.cut_short += 1
        reply = self.replies[peer]
        if reply.queued:
            after = self._reply(reply.queued.popleft())
            after.queued = reply.queued
            self.replies[peer] = after
        else:
            del self.replies[peer]
