"""A new request's lookup (vllm_lookup) against a real `kvpool serve`: the pin holds the cached prefix (the
prompt's token and one more looked up), a consumer waits, bounded, for what a producer announced, the
reservation of the prompt's pages is made by the create (a consumer's, by a step carrying the commits and frees),
and the announcements name this kvpool only."""

import threading
import time

import pytest

pytest.importorskip("vllm")

from service.client import KVPoolClient
from service.integrations.vllm_lookup import LOAD_WAIT_POLL_S, announced, announcement, look_up
from tests.integrations.test_vllm import model_dir, tokens
from tests.integrations.test_vllm_releases import cached
from tests.integrations.test_vllm_saves import calls
from tests.integrations.test_vllm_scheduler import PAGE, connected, exists, settle

__all__ = ["model_dir"]  # the tiny Llama fixture of test_vllm.py, shared


def test_the_pin_holds_the_cached_prefix_and_its_create_reserves_the_prompts_pages(model_dir: str) -> None:
    with connected(model_dir) as (server, thread, link), KVPoolClient(server.url) as client:
        prompt = tokens(1, 3 * PAGE)  # three full pages: the last token's page matches only with one more
        client.create_sequence("seed")
        seeded = client.append("seed", token_ids=prompt)
        client.free("seed")  # committed: all three pages cached
        before = calls(server)

        found = thread.call(lambda: look_up(link, prompt, None, 0, 2.0, True, [], []))
        assert found is not None
        info, reservation = found
        assert info.cached_tokens == 3 * PAGE and info.block_table[:3] == seeded.block_table[:3]
        assert reservation is None  # every full page of the prompt is cached: nothing to reserve
        assert info.length == 3 * PAGE and link.stats["lookups"] == 1 and link.stats["lookup_ns"] > 0

        longer = [*prompt, *tokens(3, 2 * PAGE + 5)]  # two full pages more to reserve (the 5 tokens: no page)
        found = thread.call(lambda: look_up(link, longer, None, 0, 2.0, True, [], []))
        assert found is not None and found[1] is not None
        info, reservation = found
        assert (reservation.start, reservation.end, reservation.state) == (3 * PAGE, 5 * PAGE, "made")
        assert reservation.instance_id == link.instance_id
        held = client.get_sequence(info.seq_id)  # at once, no answer to wait for: the create made it
        assert held.length == 5 * PAGE and held.cached_tokens == 3 * PAGE
        assert reservation.pages == held.block_table[:5] and reservation.pages[:3] == seeded.block_table[:3]
        grown = calls(server) - before
        assert grown["POST /v1/sequences"] == 2 and grown["POST /v1/step"] == 0, grown  # one call per lookup
        assert cached(client, longer) == 3 * PAGE  # the reserved pages hold no K/V: not committed
        assert link.stats["reservations"] == 1 and "reservations_refused" not in link.stats


def test_a_reservation_kvpool_cannot_make_leaves_the_pin_on_the_cached_prefix(model_dir: str) -> None:
    with connected(model_dir) as (server, thread, link), KVPoolClient(server.url) as client:
        free_pages = client.pool()["pages_free"]
        prompt = tokens(5, (free_pages + 1) * PAGE)  # more pages than the pool has
        found = thread.call(lambda: look_up(link, prompt, None, 0, 2.0, True, [], []))
        assert found is not None and found[1] is not None
        info, reservation = found
        assert reservation.state == "refused" and reservation.pages == []  # (not a fault: the save appends later)
        assert (info.length, info.cached_tokens) == (0, 0) and client.pool()["pages_used"] == 0
        assert link.stats["reservations_refused"] == 1 and link.usable()


def test_a_consumers_reservation_goes_in_a_step_carrying_the_commits_and_frees(model_dir: str) -> None:
    with connected(model_dir) as (server, thread, link), KVPoolClient(server.url) as client:
        prompt = tokens(1, 3 * PAGE)
        client.create_sequence("seed")
        client.append("seed", token_ids=prompt)
        client.free("seed")
        other = tokens(2, 2 * PAGE)
        client.create_sequence("to-free")
        client.append("to-free", token_ids=other)  # appended without K/V: committed by its free
        assert cached(client, other) == 0

        # A consumer expecting what kvpool holds already: its create reserves nothing, a step after it does.
        longer = [*prompt, *tokens(3, 2 * PAGE)]  # two pages more to reserve: the free rides on the append
        found = thread.call(lambda: look_up(link, longer, None, 3 * PAGE, 2.0, True, [], ["to-free"]))
        assert found is not None and found[1] is not None
        assert (found[1].start, found[1].end) == (3 * PAGE, 5 * PAGE)
        settle(thread, link)
        assert found[1].state == "made" and client.get_sequence(found[0].seq_id).length == 5 * PAGE
        assert not exists(server, "to-free") and cached(client, other) == 2 * PAGE
        assert link.stats["frees"] == 1


def test_a_consumer_waits_for_the_announced_tokens_bounded(model_dir: str) -> None:
    with connected(model_dir) as (server, thread, link), KVPoolClient(server.url) as client:
        prompt = tokens(4, 2 * PAGE + 3)
        began = time.monotonic()
        found = thread.call(lambda: look_up(link, prompt, None, 2 * PAGE, 0.2, False, [], []))
        assert found is not None and found[0].cached_tokens == 0 and found[1] is None
        assert time.monotonic() - began >= 0.2 and link.stats["load_wait_polls"] >= 0.2 / LOAD_WAIT_POLL_S / 4
        client.free(found[0].seq_id)

        def producer() -> None:  # the producer's save lands while the consumer waits
            time.sleep(0.1)
            with KVPoolClient(server.url) as writer:
                writer.create_sequence("producer")
                writer.append("producer", token_ids=prompt)
                writer.free("producer")

        saving = threading.Thread(target=producer)
        saving.start()
        began = time.monotonic()
        found = thread.call(lambda: look_up(link, prompt, None, 2 * PAGE, 5.0, False, [], []))
        saving.join()
        assert found is not None and found[0].cached_tokens == 2 * PAGE
        assert 0.1 <= time.monotonic() - began < 5.0


def test_announcements_name_this_kvpool_and_whole_pages(model_dir: str) -> None:
    with connected(model_dir) as (_, _, link):
        assert link.instance_id
        made = announcement(link, True, 3 * PAGE)
        assert made == {"kvpool_tokens": 3 * PAGE, "kvpool_instance": link.instance_id}
        assert announcement(link, False, 3 * PAGE) is None and announcement(link, True, 0) is None
        assert announced(link, made, 10 * PAGE) == 3 * PAGE
        assert announced(link, made, 2 * PAGE + 5) == 2 * PAGE  # capped by the prompt, in whole pages
        assert announced(link, {**made, "kvpool_instance": "another"}, 10 * PAGE) == 0
        assert announced(link, {"kvpool_tokens": "3"}, 10 * PAGE) == 0 and announced(link, None, 10 * PAGE) == 0
