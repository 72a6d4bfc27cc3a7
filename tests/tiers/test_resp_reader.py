"""The remote tier's GETEX reader (service.tiers.resp) against a real redis-server: values land in their
rows byte for byte, missing and wrong-sized values are told apart, each read refreshes the TTL, the
URL's password and database are used, TLS works, and a store gone or restarted fails the call and is reconnected
to on the next one."""

import os
import ssl

import numpy as np
import pytest

from service.tiers.resp import MISSING, WRONG_TYPE, RespConnection
from tests.tiers.conftest import RedisServer, RedisTLSServer


def test_values_into_rows_and_two_replies_in_flight(redis_server: RedisServer) -> None:
    client = redis_server.client()
    size = 70_000  # several recv calls per value, more than the line buffer
    values = [os.urandom(size) for _ in range(3)]
    client.mset({"a": values[0], "b": values[1], "c": values[2], "short": b"x" * 10})
    client.expire("a", 5)
    reader = RespConnection.from_url(redis_server.url, 2.0)
    try:
        reader.send_getex([b"a", b"missing", b"short", b"b"], 100)
        reader.send_getex([b"c", b"a"], 100)  # sent before the first replies are read
        rows = np.zeros((4, size), dtype=np.uint8)
        assert [reader.read_value([row.data]) for row in rows] == [size, MISSING, 10, size]
        assert rows[0].tobytes() == values[0] and rows[3].tobytes() == values[1]
        assert not rows[1].any() and not rows[2].any()  # nothing written for a missing or wrong-sized value
        rows2 = np.zeros((2, size), dtype=np.uint8)
        assert [reader.read_value([row.data]) for row in rows2] == [size, size]
        assert rows2[0].tobytes() == values[2] and rows2[1].tobytes() == values[0]
        assert 95 < client.ttl("a") <= 100 and 95 < client.ttl("c") <= 100  # the reads set the TTL again
        assert not client.exists("missing")  # a miss creates nothing
    finally:
        reader.close()


def test_a_value_into_parts_in_turn_and_exists_as_integers(redis_server: RedisServer) -> None:
    """read_value fills several buffers in turn (a header, a pool page's parts, a checksum) when the
    value's size is theirs together, and none of them otherwise; read_int reads EXISTS replies."""
    value = os.urandom(70_000)
    redis_server.client().mset({"v": value, "short": b"x" * 10})
    reader = RespConnection.from_url(redis_server.url, 2.0)
    try:
        reader.send_keyed(b"EXISTS", [b"v", b"missing", b"short"])
        assert [reader.read_int() for _ in range(3)] == [1, 0, 1]
        head, body, tail = bytearray(16), np.zeros(69_976, dtype=np.uint8), bytearray(8)
        parts = [memoryview(head), body.data, memoryview(tail)]
        reader.send_getex([b"v", b"short", b"missing"], 100)
        assert reader.read_value(parts) == 70_000
        assert bytes(head) + body.tobytes() + bytes(tail) == value
        fresh = [memoryview(bytearray(16)), memoryview(bytearray(69_976)), memoryview(bytearray(8))]
        assert reader.read_value(fresh) == 10 and not any(any(p) for p in fresh)  # wrong size: not kept
        assert reader.read_value(fresh) == MISSING
        redis_server.client().set("empty", b"")
        redis_server.client().rpush("list", b"x")
        reader.send_getex([b"empty", b"list", b"v"], 100)  # bad entries, answered; the stream goes on
        assert [reader.read_value(fresh), reader.read_value(fresh)] == [0, WRONG_TYPE]
        assert not any(any(p) for p in fresh) and reader.read_value(parts) == 70_000
        reader.send_getex([b"v"], 100)
        with pytest.raises(Exception, match="integer"):
            reader.read_int()  # a value where an integer was due: the stream is closed
        assert reader.sock is None
    finally:
        reader.close()


def test_password_and_database_from_the_url(redis_server: RedisServer) -> None:
    client = redis_server.client()
    client.execute_command("SELECT", 3)
    client.set("k", b"in db 3")
    client.config_set("requirepass", "s3cret")
    url = f"redis://:s3cret@127.0.0.1:{redis_server.port}/3"
    reader = RespConnection.from_url(url, 2.0)
    try:
        reader.send_getex([b"k"], 60)
        rows = np.zeros((1, 7), dtype=np.uint8)
        assert reader.read_value([rows[0].data]) == 7
        assert rows[0].tobytes() == b"in db 3"
    finally:
        reader.close()
    wrong = RespConnection.from_url(f"redis://:nope@127.0.0.1:{redis_server.port}/3", 2.0)
    with pytest.raises(Exception, match="AUTH"):
        wrong.send_getex([b"k"], 60)
    assert wrong.sock is None


def test_store_down_then_back(redis_server: RedisServer) -> None:
    redis_server.client().set("k", b"v1")
    reader = RespConnection.from_url(redis_server.url, 0.5)
    rows = np.zeros((1, 2), dtype=np.uint8)
    try:
        reader.send_getex([b"k"], 60)
        assert reader.read_value([rows[0].data]) == 2
        redis_server.stop()
        with pytest.raises(OSError):
            reader.send_getex([b"k"], 60)
            reader.read_value([rows[0].data])
        assert reader.sock is None
        redis_server.start()
        redis_server.client().set("k", b"v2")
        reader.send_getex([b"k"], 60)  # reconnects
        assert reader.read_value([rows[0].data]) == 2
        assert rows[0].tobytes() == b"v2"
    finally:
        reader.close()


def test_tls_reads_through_the_same_reader(redis_tls_server: RedisTLSServer) -> None:
    value = os.urandom(70_000)
    redis_tls_server.client().set("k", value)
    assert RespConnection.supports(redis_tls_server.url)
    reader = RespConnection.from_url(redis_tls_server.url, 2.0)
    rows = np.zeros((2, len(value)), dtype=np.uint8)
    try:
        reader.send_getex([b"k", b"missing"], 60)
        assert [reader.read_value([row.data]) for row in rows] == [len(value), MISSING]
        assert rows[0].tobytes() == value
        assert isinstance(reader.sock, ssl.SSLSocket)
    finally:
        reader.close()
    # Without the CA the certificate is refused: nothing read, the connection closed.
    bare = RespConnection.from_url(redis_tls_server.url.split("?")[0], 2.0)
    with pytest.raises(ssl.SSLError):
        bare.send_getex([b"k"], 60)
    assert bare.sock is None
    # A TLS option this reader does not handle leaves the reads to redis-py.
    assert not RespConnection.supports(redis_tls_server.url + "&ssl_min_version=3")
