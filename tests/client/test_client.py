"""KVPoolClient and AsyncKVPoolClient against a real server: every endpoint, typed errors."""

import asyncio
from collections.abc import Iterator

import httpx
import pytest
import torch

from service.client import AsyncKVPoolClient, KVPoolClient, SequenceInfo, error_from_envelope
from service.core import errors
from tests.conftest import SMALL_POOL, Server
from tests.e2e.test_walkthrough import dense_attention


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """One server for the module (2 layers, 2 KV heads, head_dim 16, page 4, 16 pages)."""
    server = Server(SMALL_POOL)
    yield server.url
    server.stop()


@pytest.fixture
def client(url: str) -> Iterator[KVPoolClient]:
    with KVPoolClient(url) as c:
        yield c


def test_sequence_endpoints(client: KVPoolClient) -> None:
    torch.manual_seed(0)
    created = client.create_sequence("c1")
    assert (created.seq_id, created.length, created.block_table, created.cached_tokens) == ("c1", 0, [], 0)
    k, v = torch.randn(2, 5, 2, 16), torch.randn(2, 5, 2, 16)
    appended = client.append("c1", 5, k=k, v=v)
    assert appended.length == 5 and len(appended.block_table) == 2
    table = appended.block_table
    assert appended.slots == [table[0] * 4 + i for i in range(4)] + [table[1] * 4]
    assert client.get_sequence("c1") == SequenceInfo(seq_id="c1", length=5, block_table=table, cached_tokens=0)

    child = client.fork("c1", "c1-child")
    assert (child.seq_id, child.length, child.block_table) == ("c1-child", 5, table)
    anonymous = client.fork("c1")
    assert len(anonymous.seq_id) == 32 and anonymous.block_table == table
    # The shared partial last page is copied before the child writes into it.
    grown = client.append("c1-child", token_ids=[7, 8])
    assert grown.block_table[0] == table[0] and grown.block_table[1] != table[1]

    assert client.free(anonymous.seq_id) == 0  # every page still held by c1
    assert client.free("c1-child") == 1  # its copied page
    assert client.free("c1") == 2
    assert client.pool()["num_sequences"] == 0


def test_a_free_without_commit_leaves_nothing_to_hit(client: KVPoolClient) -> None:
    """A writer that could not write what it appended frees with commit=False: no prefix hits those pages."""
    prompt = [11, 12, 13, 14, 21, 22, 23, 24, 31]  # two full pages of 4
    assert client.create_sequence("w", prompt).cached_tokens == 0
    client.append("w", token_ids=prompt[:8])  # K/V to be written through the mapped pool: not committed yet
    assert client.free("w", commit=False) == 2
    probe = client.create_sequence("probe", prompt)
    assert probe.cached_tokens == 0
    client.append("probe", token_ids=prompt[:8])
    client.free("probe")  # committed this time
    assert client.create_sequence("again", prompt).cached_tokens == 8
    client.free("again")
    assert client.pool()["num_sequences"] == 0


def test_step_and_attend(client: KVPoolClient) -> None:
    torch.manual_seed(1)
    for seq_id in ("s-a", "s-b"):
        client.create_sequence(seq_id)
    step = client.step([("s-a", 6), ("s-b", 2, [11, 12])])
    tables = [client.get_sequence(s).block_table for s in ("s-a", "s-b")]
    assert step.lookup_table.dtype == torch.uint32 and step.lookup_table.shape == (2, 24)
    for row, table in zip(step.lookup_table.tolist(), tables):
        assert row == table + [step.sentinel] * (24 - len(table))
    assert step.sentinel == 16 and step.cache_lengths.tolist() == [0, 0] and step.input_lengths == [6, 2]
    assert (step.max_prompt_length, step.max_cache_length) == (6, 0)
    assert step.slots == [[tables[0][i // 4] * 4 + i % 4 for i in range(6)], [tables[1][0] * 4, tables[1][0] * 4 + 1]]

    # attend writes the k/v of the queried positions (all of them here), then attends
    ka, va, kb, vb = (torch.randn(6 if i < 2 else 2, 2, 16) for i in range(4))
    q = torch.randn(8, 4, 16)
    out = client.attend(1, ["s-a", "s-b"], q, q_lens=[6, 2], k=torch.cat([ka, kb]), v=torch.cat([va, vb]))
    expected = torch.cat([dense_attention(q[:6], ka, va), dense_attention(q[6:], kb, vb)])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # decode-style: one query per sequence (the default q_lens), softcap and scale passed through
    out = client.attend(1, ["s-a"], q[5:6], scale=0.25, softcap=30.0)
    assert out.shape == (1, 4, 16) and torch.isfinite(out).all()
    step = client.step([], seq_ids=["s-b", "s-a"])
    assert step.cache_lengths.tolist() == [2, 6] and step.slots == [[], []]
    # A step's frees ride on it: s-b freed after s-a's append (the table has s-a's row only), then s-a alone.
    step = client.step([("s-a", 1)], free=["s-b"])
    assert step.cache_lengths.tolist() == [6] and step.input_lengths == [1]
    assert client.pool()["num_sequences"] == 1
    step = client.step([], [], free=["s-a"])
    assert step.lookup_table.shape[0] == 0 and client.pool()["num_sequences"] == 0


def test_probes_pool_and_ipc(client: KVPoolClient) -> None:
    assert client.healthz() == {"status": "ok"}
    ready = client.readyz()
    assert ready["status"] == "ready"
    pool = client.pool()
    assert (pool["num_layers"], pool["num_kv_heads"], pool["head_dim"], pool["page_size"]) == (2, 2, 16, 4)
    assert pool["pages_used"] + pool["pages_cached"] + pool["pages_free"] == 16
    ipc = client.ipc()
    assert ipc["instance_id"] == ready["instance_id"] == pool["instance_id"]
    assert ipc["blocks"]["shape"] == [17, 2, 2, 4, 2, 16]


def test_errors_from_the_server_are_typed(client: KVPoolClient, url: str) -> None:
    with pytest.raises(errors.SequenceNotFound) as not_found:
        client.get_sequence("nobody")
    assert not_found.value.seq_id == "nobody" and not_found.value.status == 404  # type: ignore[attr-defined]
    client.create_sequence("dup")
    with pytest.raises(errors.SequenceExists) as exists:
        client.create_sequence("dup")
    assert exists.value.seq_id == "dup"
    with pytest.raises(errors.OutOfPages) as oop:
        client.append("dup", 100)  # 25 pages of a 16-page pool
    assert (oop.value.needed, oop.value.available, oop.value.code) == (25, 16, "out_of_pages")
    envelope = httpx.post(url + "/v1/sequences/dup/append", json={"num_tokens": 100}).json()["error"]
    assert envelope["details"] == {"needed": 25, "available": 16}  # the fields as data, not only in the message
    assert httpx.get(url + "/v1/sequences/nobody").json()["error"]["details"] == {"seq_id": "nobody"}
    assert client.get_sequence("dup").length == 0, "a failed append changes nothing"
    with pytest.raises(errors.InvalidRequest, match="layer 5 is out of range"):
        client.attend(5, ["dup"], torch.randn(1, 4, 16))
    with pytest.raises(errors.InvalidRequest, match="num_tokens"):
        client.append("dup", 0)
    client.free("dup")
    # An unknown code (here a wrong base URL: a 404 with code "not_found") keeps its code.
    with KVPoolClient(url + "/wrong") as lost, pytest.raises(errors.KVPoolError) as generic:
        lost.pool()
    assert type(generic.value) is errors.KVPoolError and generic.value.code == "not_found"


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        ("invalid_request", errors.InvalidRequest),
        ("sequence_not_found", errors.SequenceNotFound),
        ("sequence_exists", errors.SequenceExists),
        ("out_of_pages", errors.OutOfPages),
        ("quota_exceeded", errors.QuotaExceeded),
        ("unauthorized", errors.Unauthorized),
        ("forbidden", errors.Forbidden),
        ("payload_too_large", errors.PayloadTooLarge),
    ],
)
def test_every_error_code_has_its_class(code: str, cls: type[errors.KVPoolError]) -> None:
    exc = error_from_envelope(418, code, "the message")
    assert type(exc) is cls and exc.code == code and exc.message == "the message" == str(exc)
    assert exc.status == 418  # type: ignore[attr-defined]


def test_arguments_are_checked_before_sending(client: KVPoolClient) -> None:
    with pytest.raises(ValueError, match="num_tokens or token_ids"):
        client.append("x")
    with pytest.raises(ValueError, match="v needs k"):
        client.append("x", 1, v=torch.randn(2, 1, 2, 16))
    # k alone is an MLA pool's latent: the client sends it, and this (plain) pool's server refuses it.
    with pytest.raises(errors.InvalidRequest, match="k and v come together"):
        client.append("x", 1, k=torch.randn(2, 1, 2, 16))
    assert KVPoolClient(api_key="secret").http.headers["Authorization"] == "Bearer secret"


def test_async_client(url: str) -> None:
    async def scenario() -> None:
        torch.manual_seed(2)
        async with AsyncKVPoolClient(url) as client:
            assert (await client.healthz())["status"] == "ok"
            await client.create_sequence("as1")
            k, v = torch.randn(2, 3, 2, 16), torch.randn(2, 3, 2, 16)
            appended = await client.append("as1", 3, k=k, v=v)
            assert appended.length == 3
            q = torch.randn(2, 4, 16)
            out = await client.attend(0, ["as1"], q, q_lens=[2])
            torch.testing.assert_close(out.double(), dense_attention(q, k[0], v[0]), atol=1e-5, rtol=1e-5)
            step = await client.step([("as1", 1)])
            assert step.cache_lengths.tolist() == [3]
            child = await client.fork("as1", "as1-child")
            assert (await client.get_sequence("as1-child")).block_table == child.block_table
            with pytest.raises(errors.SequenceNotFound):
                await client.free("nobody")
            assert (await client.free("as1-child")) >= 0
            await client.free("as1")
            ipc, ready, pool = await client.ipc(), await client.readyz(), await client.pool()
            assert ipc["instance_id"] == ready["instance_id"] == pool["instance_id"]
            with await client.attach() as attached:
                await client.check_attached(attached)
                assert list(attached.blocks.shape) == ipc["blocks"]["shape"]

    asyncio.run(scenario())
