"""The remote tier's writes over its own connection (service.tiers.resp.send_parts, RemoteStore.put) against
real redis-servers: values sent from their buffers land byte for byte however many buffers and however large,
over TCP, TLS and a unix socket; a refused SET is told and the stream goes on; an idle connection the store
closed is replaced before a write rather than failing it."""

import os
from pathlib import Path

import numpy as np
import pytest

from service.tiers.entries import EntryFormat, KeyedMac
from service.tiers.remote import RemoteStore
from service.tiers.resp import BIG_PART, IOV_MAX, RespConnection, RespError, encode, encode_parts
from tests.tiers.conftest import RedisServer, RedisTLSServer

PAGE_NBYTES = 3 * BIG_PART + 5  # a page sent from where it lies


def sets(values: dict[bytes, list[bytes | memoryview]], ttl: int = 100) -> list[list[list[bytes | memoryview]]]:
    return [[[b"SET"], [key], parts, [b"EX"], [str(ttl).encode()]] for key, parts in values.items()]


def test_encode_parts_sends_encodes_bytes_with_the_large_parts_as_they_lie() -> None:
    page = np.arange(PAGE_NBYTES, dtype=np.uint8) * 7
    commands = sets({b"k": [b"head", page.data, b"tag"], b"small": [b"x" * 10]})
    buffers = encode_parts(commands)
    assert b"".join(bytes(b) for b in buffers) == encode([[b"".join(bytes(p) for p in a) for a in c] for c in commands])
    big = [b for b in buffers if isinstance(b, memoryview)]
    assert len(big) == 1 and big[0].obj is page  # not copied


def test_many_large_values_in_one_send_land_byte_for_byte(redis_server: RedisServer) -> None:
    """More buffers than one sendmsg takes and more bytes than the socket holds: partial sends go on."""
    rows = np.random.default_rng(0).integers(0, 256, (IOV_MAX, PAGE_NBYTES), dtype=np.uint8)
    values = {b"k%d" % i: [os.urandom(40), row.data, os.urandom(8)] for i, row in enumerate(rows)}
    assert len(encode_parts(sets(values))) > IOV_MAX and rows.nbytes > 8 << 20
    conn = RespConnection.from_url(redis_server.url, 2.0)
    try:
        conn.send_parts(sets(values))
        assert [conn.read_status() for _ in values] == [None] * len(values)
    finally:
        conn.close()
    client = redis_server.client()
    for key, (head, row, tag) in values.items():
        assert client.get(key) == head + bytes(row) + tag
    assert 95 < client.ttl(b"k0") <= 100


def test_a_refused_set_is_told_and_the_stream_goes_on(redis_server: RedisServer) -> None:
    conn = RespConnection.from_url(redis_server.url, 2.0)
    try:
        commands = sets({b"a": [b"1"]}) + sets({b"b": [b"2"]}, ttl=0) + sets({b"c": [b"3"]})  # EX 0: refused
        conn.send_parts(commands)
        replies = [conn.read_status() for _ in commands]
        assert replies[0] is None and replies[2] is None
        assert replies[1] is not None and replies[1].startswith(b"-ERR") and b"expire" in replies[1]
        conn.send_keyed(b"EXISTS", [b"a", b"b", b"c"])
        assert [conn.read_int() for _ in range(3)] == [1, 0, 1]
        conn.send_keyed(b"EXISTS", [b"a"])
        with pytest.raises(RespError, match="status"):
            conn.read_status()  # an integer where a status was due: the stream is closed
        assert conn.sock is None
    finally:
        conn.close()


def test_an_idle_connection_the_store_closed_is_replaced_before_a_write(redis_server: RedisServer) -> None:
    conn = RespConnection.from_url(redis_server.url, 2.0)
    try:
        conn.send_parts(sets({b"a": [b"1"]}))
        assert conn.read_status() is None
        conn.drop_if_closed()
        assert conn.sock is not None  # an open, quiet connection is kept
        redis_server.stop()
        redis_server.start()  # empty, on the same port: the old connection is closed
        conn.drop_if_closed()
        assert conn.sock is None
        conn.send_parts(sets({b"b": [b"2"]}))
        assert conn.read_status() is None and redis_server.client().get(b"b") == b"2"
    finally:
        conn.close()


def test_tls_and_unix_socket_writes(redis_tls_server: RedisTLSServer, redis_unix: Path) -> None:
    page = np.random.default_rng(1).integers(0, 256, PAGE_NBYTES, dtype=np.uint8)
    for url, client in [(redis_tls_server.url, redis_tls_server.client()), (f"unix://{redis_unix}", None)]:
        conn = RespConnection.from_url(url, 2.0)
        try:
            conn.send_parts(sets({b"p": [b"h", page.data, b"t"]}))
            assert conn.read_status() is None
            conn.send_getex([b"p"], 100)
            out = np.zeros(PAGE_NBYTES + 2, dtype=np.uint8)
            assert conn.read_value([out.data]) == PAGE_NBYTES + 2
            assert out.tobytes() == b"h" + page.tobytes() + b"t"
        finally:
            conn.close()
        if client is not None:
            assert client.get(b"p") == b"h" + page.tobytes() + b"t"


@pytest.mark.parametrize("secret", ["", "s3cret"])
def test_put_writes_the_entries_a_read_loads(redis_server: RedisServer, secret: str) -> None:
    entries = EntryFormat("g", KeyedMac(secret.encode()) if secret else None)
    store = RemoteStore(redis_server.url, 2.0, 600, entries, PAGE_NBYTES)
    data = np.random.default_rng(2).integers(0, 256, (5, PAGE_NBYTES), dtype=np.uint8)
    hashes, tokens = [os.urandom(32) for _ in data], [os.urandom(64) for _ in data]
    try:
        assert store.writer is not None
        sent = store.put(hashes, tokens, data)
        header_nbytes = entries.header_nbytes(hashes[0], tokens[0])
        assert sent == 5 * (header_nbytes + PAGE_NBYTES + entries.seal.tag_nbytes)
        client = redis_server.client()
        for h, t, row in zip(hashes, tokens, data):
            value = client.get(entries.key(h))
            if not secret:  # the checksum's entries are deterministic: what encode() makes
                assert value == entries.encode(h, t, row.data)
            decoded = entries.decode(value, h, t, PAGE_NBYTES)
            assert decoded is not None and decoded.tobytes() == row.tobytes()
        assert 590 < client.ttl(entries.key(hashes[0])) <= 600
        into = np.zeros_like(data)
        assert store.get_into(hashes, tokens, [[row.data] for row in into]) == 5
        assert (into == data).all()
    finally:
        store.close()


def test_put_raises_when_the_store_refuses_and_writes_again_after(redis_server: RedisServer) -> None:
    store = RemoteStore(redis_server.url, 2.0, 600, EntryFormat("g"), PAGE_NBYTES)
    data = np.ones((3, PAGE_NBYTES), dtype=np.uint8)
    hashes, tokens = [os.urandom(32) for _ in data], [b"t" * 16] * 3
    client = redis_server.client()
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", "1")
    try:
        with pytest.raises(RespError, match=r"OOM.*3 of 3 refused"):
            store.put(hashes, tokens, data)
        assert client.dbsize() == 0
        client.config_set("maxmemory", "0")
        store.put(hashes, tokens, data)  # the same connection: its stream was read to the end
        assert client.dbsize() == 3
    finally:
        store.close()
