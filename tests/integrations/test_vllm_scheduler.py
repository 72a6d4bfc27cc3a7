"""The scheduler side's pins: a load job names the instance its pin was made on, and a pin released while ranks
may still be copying from it (its request finished or was aborted between the step's plan and the ranks'
reports) stays held in kvpool until every rank has reported that load.

vLLM's own scheduler objects (Request, KVCacheBlocks, SchedulerOutput, KVConnectorOutput) drive the connector's
scheduler side against a real `kvpool serve`, one call at a time, so that the reports can come in the order
under test (a real engine reports a step's loads before it could release their pins).
"""

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from service.client import KVPoolClient
from service.integrations.kvpool_link import Geometry, KVPoolLink
from service.integrations.vllm_metadata import KVPoolMetadata, KVPoolWorkerMeta, Role
from service.integrations.vllm_saves import free_all
from service.integrations.vllm_scheduler import KVPoolConnectorScheduler
from service.integrations.vllm_thread import ConnectorThread
from tests.integrations.test_vllm import KVPool, model_dir, tokens
from tests.integrations.test_vllm_saves import calls

__all__ = ["model_dir"]  # the tiny Llama fixture of test_vllm.py, shared
PAGE = 16
RANKS = 2  # two ranks load every pin: both must report before it is released


def exists(server: KVPool, seq_id: str) -> bool:
    answer = server.client.get(f"/v1/sequences/{seq_id}")
    assert answer.status_code in (200, 404), answer.text
    return answer.status_code == 200


@contextmanager
def connected(model_dir: str) -> Iterator[tuple[KVPool, ConnectorThread, KVPoolLink]]:
    """A `kvpool serve` with the model's geometry, a connector thread, and a scheduler-side link connected to the
    server; all closed after."""
    server = KVPool(model_dir, PAGE)
    thread = ConnectorThread(8, ordered=True)
    link: KVPoolLink | None = None
    try:
        pool = server.pool()
        geometry = Geometry(pool["num_layers"], pool["num_kv_heads"], pool["head_dim"], pool["dtype"])
        link = KVPoolLink(server.url, None, geometry, 10.0, 1.0, "scheduler")
        assert link.connect(at_start=True)
        yield server, thread, link
    finally:
        thread.close()
        if link is not None:
            link.close()
        server.stop()


def settle(thread: ConnectorThread, link: KVPoolLink) -> None:
    """Whatever the connector's thread had queued has run, and the answer of its last call sent unanswered (the
    frees) is read: kvpool has done all of it."""
    thread.drain()
    thread.call(link.client.settle)


def test_a_pin_is_released_only_once_every_rank_has_reported_its_load(model_dir: str, tmp_path: Path) -> None:
    with connected(model_dir) as (server, thread, link):
        prompt = tokens(3, 4 * PAGE + 5)
        with KVPoolClient(server.url) as seeder:  # 4 pages of the prompt cached in kvpool
            seeder.create_sequence("seed")
            seeder.append("seed", token_ids=prompt[: 4 * PAGE])
            seeder.free("seed")  # (committing its full pages)
        pool = server.pool()
        scheduler = KVPoolConnectorScheduler(link, thread, Counter(), PAGE, RANKS, Role())
        request = Request("r1", prompt, SamplingParams(max_tokens=1), None)

        hit, _ = scheduler.get_num_new_matched_tokens(request, 0)
        assert hit == 4 * PAGE
        blocks = KVCacheBlocks(([KVCacheBlock(block_id) for block_id in range(5)],))
        scheduler.update_state_after_alloc(request, blocks, hit)
        meta = scheduler.build_connector_meta(SchedulerOutput.make_empty(), None)
        assert isinstance(meta, KVPoolMetadata) and len(meta.loads) == 1
        job = meta.loads[0]
        assert job.instance_id == pool["instance_id"] and job.start == 0 and job.count == hit
        assert exists(server, job.pin_id) and server.pool()["pages_used"] == 4

        scheduler.request_finished(request, [])  # aborted before the ranks report: the pin stays
        scheduler.build_connector_meta(SchedulerOutput.make_empty(), None)  # (a step: frees would go now)
        settle(thread, link)
        assert exists(server, job.pin_id) and server.pool()["pages_used"] == 4

        def report(ranks: int) -> None:
            worker = KVPoolWorkerMeta(loaded=Counter({job.pin_id: ranks}))
            scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=worker))
            scheduler.build_connector_meta(SchedulerOutput.make_empty(), None)  # the next step
            settle(thread, link)

        report(1)  # one rank of two: still held
        assert exists(server, job.pin_id) and server.pool()["pages_used"] == 4
        report(1)  # every rank: released (committing nothing new), its pages cached again
        assert not exists(server, job.pin_id)
        after = server.pool()
        assert after["pages_used"] == 0 and after["pages_cached"] == 4, after
        assert not any(k.startswith("faults") for k in link.stats), link.stats


def test_the_lookup_answer_names_the_instance(model_dir: str) -> None:
    server = KVPool(model_dir, PAGE)
    try:
        with KVPoolClient(server.url) as client:
            named = client.create_sequence("a", tokens(1, 2 * PAGE), instance=True)
            plain = client.create_sequence("b", tokens(1, 2 * PAGE))
        assert named.instance_id == server.pool()["instance_id"] and plain.instance_id is None
        raw = httpx.post(f"{server.url}/v1/sequences?instance=true", json={"seq_id": "c"}, timeout=10)
        assert raw.status_code == 201 and raw.json()["instance_id"] == named.instance_id
    finally:
        server.stop()


class Steps:
    """vLLM's scheduler loop, one step at a time, around the connector's scheduler side: a real KVCacheManager
    allocates each step's blocks, the plan is built, the requests advance, and every rank reports each save
    written (`ranks`)."""

    def __init__(self, scheduler: KVPoolConnectorScheduler, ranks: int) -> None:
        import torch
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        spec = FullAttentionSpec(block_size=PAGE, num_kv_heads=2, head_size=32, dtype=torch.float32)
        config = KVCacheConfig(64, [], [KVCacheGroupSpec(["layer"], spec)])
        self.manager = KVCacheManager(config, 1024, PAGE, PAGE, enable_caching=False)
        self.scheduler, self.ranks, self.running = scheduler, ranks, []  # type: list[Request]

    def add(self, request: Request) -> None:
        self.scheduler.get_num_new_matched_tokens(request, 0)
        blocks = self.manager.allocate_slots(request, request.num_prompt_tokens)
        assert blocks is not None
        self.scheduler.update_state_after_alloc(request, blocks, 0)
        self.running.append(request)

    def step(self) -> KVPoolMetadata:
        """One step: a new request's whole prompt, one token for each decoding one."""
        out = SchedulerOutput.make_empty()
        out.num_scheduled_tokens = {r.request_id: r.num_tokens - r.num_computed_tokens for r in self.running}
        for request in self.running:
            if request.num_computed_tokens:
                assert self.manager.allocate_slots(request, 1) is not None
        meta = self.scheduler.build_connector_meta(out, self.manager)
        assert isinstance(meta, KVPoolMetadata)
        for request in self.running:
            request.num_computed_tokens = request.num_tokens
            request.append_output_token_ids(7)
        written = Counter({job.save_id: self.ranks for job in meta.saves})
        output = KVConnectorOutput(kv_connector_worker_meta=KVPoolWorkerMeta(written=written))
        self.scheduler.update_connector_output(output)
        return meta

    def finish(self, request: Request) -> bool:
        self.running.remove(request)
        blocks = list(self.manager.get_block_ids(request.request_id)[0])
        delay, _ = self.scheduler.request_finished(request, blocks)
        return delay


def saved(meta: KVPoolMetadata) -> list[tuple[str, int, int]]:
    return [(job.req_id, job.start, job.end) for job in meta.saves]


def test_decoded_pages_ride_on_a_call_made_anyway_until_the_request_finishes(model_dir: str) -> None:
    """Without reservations: a prompt's save is a call of its step, and pages filled by decoding ride on such a
    call; a request's last pages are saved by the step after it finishes, in a call the step waits for. The
    commits of written saves ride on those calls too (within FREE_WAIT_S)."""
    with connected(model_dir) as (server, thread, link):
        scheduler = KVPoolConnectorScheduler(link, thread, Counter(), PAGE, 1, Role(reserve=False))
        scheduler._releases.wait_s = 600  # (however slow the machine: the commits wait for a call)
        steps = Steps(scheduler, 1)
        a = Request("a", tokens(5, 40), SamplingParams(max_tokens=100), None)  # stopped early (a stop token)
        b = Request("b", tokens(6, 50), SamplingParams(max_tokens=17), None)  # runs to its max_tokens

        steps.add(a)
        assert saved(steps.step()) == [("a", 0, 32)]  # a's prompt: its 2 full pages
        quiet = [steps.step() for _ in range(10)]  # a decodes through token 48 (a third page): no call for it
        assert a.num_computed_tokens == 50 and not any(m.saves for m in quiet)
        steps.add(b)
        assert saved(steps.step()) == [("b", 0, 48), ("a", 32, 48)]  # a's third page rides on b's prompt's call
        quiet = [steps.step() for _ in range(16)]  # (through b's 17th and last token: nothing to ride on)
        assert b.num_output_tokens == 17 and not any(m.saves for m in quiet)
        assert steps.finish(b)  # (its last page is to be saved: vLLM keeps its blocks until then)
        last = steps.step()  # b's last page, and a's fourth riding on its call
        assert saved(last) == [("a", 48, 64), ("b", 48, 64)] and last.finish_saved == {"b"}
        quiet = [steps.step() for _ in range(17)]
        assert a.num_computed_tokens == 85 and not any(m.saves for m in quiet)  # a's fifth page: not yet
        assert steps.finish(a)
        last = steps.step()
        assert saved(last) == [("a", 64, 80)] and last.finish_saved == {"a"}
        assert not steps.step().saves and not scheduler.has_pending_push_work()  # (freed on the thread)
        settle(thread, link)
        made = calls(server)
        assert link.stats["saves"] == 6 and link.stats.get("reservations", 0) == 0
        # b's prompt and b's last page (a's riding), a's last page (the commit of its fourth riding): steps; a's
        # prompt alone. Every commit rode on an append (none was sent alone), and the two frees went in one call.
        assert made["POST /v1/step"] - link.stats["free_calls"] == 3, made
        assert made["POST /v1/sequences/{seq_id}/append"] == 1, made
        assert link.stats["free_calls"] == 1 and link.stats["commits"] == 0, link.stats
        with KVPoolClient(server.url) as client:  # kvpool holds a's 80 tokens and b's 64
            assert client.create_sequence("check-a", a.all_token_ids[:81]).cached_tokens == 80
            assert client.create_sequence("check-b", b.all_token_ids[:65]).cached_tokens == 64
            client.free("check-a")
            client.free("check-b")
        after = server.pool()
        assert (after["pages_used"], after["num_sequences"]) == (0, 0), after


def test_reserved_pages_take_every_save_off_the_steps_and_carry_the_commits_and_frees(model_dir: str) -> None:
    """With reservations: a prompt's pages are appended by its lookup's create, a finished request's last pages
    when it finishes (that answer not waited for); no step waits for a call to save, and the written saves'
    commits and the finished requests' frees ride on the finished requests' appends where they come first (a
    create carries none). A request that cannot fill another page has its written save freed (committing)
    rather than held."""
    with connected(model_dir) as (server, thread, link):
        scheduler = KVPoolConnectorScheduler(link, thread, Counter(), PAGE, 1, Role())
        scheduler._releases.wait_s = 3600  # (nothing flushed for having waited: what rides on what is exact)
        steps = Steps(scheduler, 1)
        a = Request("a", tokens(5, 40), SamplingParams(max_tokens=100), None)
        b = Request("b", tokens(6, 50), SamplingParams(max_tokens=17), None)
        c = Request("c", tokens(7, 20), SamplingParams(max_tokens=2), None)

        def step() -> list[tuple[str, int, int]]:
            """A step's saves: the step waits for no append (a call of commits and frees is not waited for)."""
            meta = steps.step()
            assert link.stats.get("append_ns", 0) == 0
            return saved(meta)

        steps.add(a)
        assert step() == [("a", 0, 32)]  # into the pages its lookup's create reserved
        assert len(scheduler._releases.to_commit) == 1  # a's prompt: written by every rank, to commit
        steps.add(b)  # b's lookup: its create reserves b's pages and carries no commit
        assert len(scheduler._releases.to_commit) == 1 and link.stats.get("commits", 0) == 0
        assert step() == [("b", 0, 48)]  # (nothing else rides on anything: a's decoded pages wait)
        assert len(scheduler._releases.to_commit) == 2  # b's prompt too
        assert [step() for _ in range(16)] == [[]] * 16  # through b's 17th and last token
        assert b.num_output_tokens == 17 and a.num_computed_tokens == 57
        assert steps.finish(b)  # b's last page appended now to its prompt's sequence: vLLM keeps its blocks
        assert b.request_id in scheduler._finishing and scheduler._finishing["b"].reserved is not None
        link.client.settle()  # (its answer read: counted) a's commit rode on it, b's is that append's own
        assert not scheduler._releases.to_commit and link.stats["commits"] == 1 and link.stats.get("free_calls", 0) == 0
        assert step() == [("b", 48, 64)] and steps.scheduler._finishing == {}
        assert len(scheduler._releases.to_free) == 1  # b's sequence, written: to free (committing)
        steps.add(c)  # its lookup's create carries no free
        assert len(scheduler._releases.to_free) == 1 and link.stats.get("frees", 0) == 0
        assert step() == [("c", 0, 16)]
        # c cannot fill another page (20 + 2 - 1 tokens at most): its written save is to be freed, not held
        assert "c" not in scheduler._held and len(scheduler._releases.to_free) == 2
        commits = link.stats["commits"]
        assert step() == []  # (c's second and last token) both frees go with this step, in one call
        settle(thread, link)
        assert scheduler._releases.to_free == [] and (link.stats["free_calls"], link.stats["frees"]) == (1, 2)
        assert link.stats["commits"] == commits  # (the frees committed b's and c's pages: no commit of their own)
        steps.finish(c)  # nothing to save or free
        assert not scheduler._releases.to_free
        while a.num_computed_tokens < 81:
            assert step() == []
        assert steps.finish(a)  # its third to fifth pages, reserved in one append
        assert step() == [("a", 32, 80)]
        while scheduler.has_pending_push_work():
            assert step() == []
        settle(thread, link)
        made = calls(server)
        assert (link.stats["saves"], link.stats["reservations"]) == (5, 5), link.stats
        # Three creates (each reserving its prompt), two finished requests' appends, the calls of frees alone.
        assert made["POST /v1/step"] == 2 + link.stats["free_calls"] and made["POST /v1/sequences"] == 3, made
        assert made["POST /v1/sequences/{seq_id}/append"] == 0 and made["DELETE /v1/sequences/{seq_id}"] == 0, made
        with KVPoolClient(server.url) as client:  # kvpool holds a's 80 tokens, b's 64 and c's 16
            for name, request, cached in (("a", a, 80), ("b", b, 64), ("c", c, 16)):
                check = client.create_sequence(f"check-{name}", request.all_token_ids[: cached + 1])
                assert check.cached_tokens == cached, name
                client.free(f"check-{name}")
        after = server.pool()
        assert (after["pages_used"], after["num_sequences"]) == (0, 0), after
        assert not any(k.startswith("faults") for k in link.stats), link.stats


def test_frees_alone_are_not_waited_for_and_a_refused_call_frees_one_at_a_time(model_dir: str) -> None:
    """A call of frees alone is written and left: the server frees the sequences while the connector goes on,
    and its answer is read with the link's next call. A refused one (a sequence gone) frees the others one
    call each then, as a waited-for call did."""
    with connected(model_dir) as (server, _, link):
        for name, seed in (("a", 1), ("b", 2), ("c", 3)):
            server.client.post("/v1/sequences", json={"seq_id": name, "token_ids": tokens(seed, 40)})
        free_all(link, ["a", "b"])
        assert link.client.http._unanswered is not None  # written, its answer not read
        deadline = time.monotonic() + 10
        while (exists(server, "a") or exists(server, "b")) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not exists(server, "a") and not exists(server, "b")
        assert (link.stats["free_calls"], link.stats["frees"]) == (1, 2)
        assert link.client.pool()["num_sequences"] == 1  # the next call reads the answer first: no fault
        assert link.client.http._unanswered is None and not any(k.startswith("faults") for k in link.stats)
        free_all(link, ["c", "a"])  # "a" is gone: kvpool refuses the whole call
        link.client.settle()
        assert not exists(server, "c")  # freed by a call of its own once the refusal was read
        assert (link.stats["faults_error"], calls(server)["DELETE /v1/sequences/{seq_id}"]) == (2, 2), link.stats
        after = server.pool()
        assert (after["pages_used"], after["num_sequences"]) == (0, 0), after


def test_a_prompts_pages_reserved_with_its_lookup_are_saved_into_without_a_call_or_released_uncommitted(
    model_dir: str,
) -> None:
    """The lookup appends the prompt's full pages to the pin, its answer not waited for; the prompt's save writes
    into them with no call in its step. A request that ends before its prompt is saved has them released
    uncommitted: no prefix ever finds a page whose K/V was not written."""
    with connected(model_dir) as (server, thread, link):
        scheduler = KVPoolConnectorScheduler(link, thread, Counter(), PAGE, 1, Role())
        steps = Steps(scheduler, 1)
        prompt = tokens(4, 3 * PAGE + 5)

        aborted = Request("aborted", prompt, SamplingParams(max_tokens=4), None)
        assert scheduler.get_num_new_matched_tokens(aborted, 0) == (0, False)
        link.client.settle()
        pin = scheduler._pins["aborted"]
        assert pin.reserved is not None and pin.reserved.state == "made" and len(pin.reserved.pages) == 3
        assert server.client.get(f"/v1/sequences/{pin.seq_id}").json()["length"] == 3 * PAGE
        assert scheduler.request_finished(aborted, []) == (False, None)
        settle(thread, link)
        assert not exists(server, pin.seq_id)
        after = server.pool()
        assert (after["pages_used"], after["pages_cached"]) == (0, 0), after  # released, never committed

        saved = Request("saved", prompt, SamplingParams(max_tokens=2), None)
        steps.add(saved)
        link.client.settle()
        pin_id, reserved = scheduler._pins["saved"].seq_id, scheduler._pins["saved"].reserved
        assert reserved is not None and reserved.state == "made" and len(reserved.pages) == 3
        before = calls(server)
        meta = steps.step()  # the prompt's step: its save goes into the reserved pages, no call made
        assert [route for route in calls(server) - before if route != "GET /metrics"] == []
        assert [(job.seq_id, job.pages, job.start, job.end) for job in meta.saves] == [
            (pin_id, reserved.pages, 0, 3 * PAGE)
        ]
        steps.step()  # (its last token)
        steps.finish(saved)
        assert not steps.step().saves
        settle(thread, link)
        assert not exists(server, pin_id)
        with KVPoolClient(server.url) as client:  # written by every rank: committed
            assert client.create_sequence("check", prompt).cached_tokens == 3 * PAGE
            client.free("check")
        assert server.pool()["pages_used"] == 0
        assert not any(k.startswith("faults") for k in link.stats), link.stats
