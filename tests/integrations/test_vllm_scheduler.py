"""The scheduler side's pins: a load job names the instance its pin was made on, and a pin released while ranks
may still be copying from it (its request finished or was aborted between the step's plan and the ranks'
reports) stays held in kvpool until every rank has reported that load.

vLLM's own scheduler objects (Request, KVCacheBlocks, SchedulerOutput, KVConnectorOutput) drive the connector's
scheduler side against a real `kvpool serve`, one call at a time, so that the reports can come in the order
under test (a real engine reports a step's loads before it could release their pins).
"""

from collections import Counter
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
from service.integrations.vllm_scheduler import KVPoolConnectorScheduler
from service.integrations.vllm_thread import ConnectorThread
from tests.integrations.test_vllm import KVPool, model_dir, tokens

__all__ = ["model_dir"]  # the tiny Llama fixture of test_vllm.py, shared
PAGE = 16
RANKS = 2  # two ranks load every pin: both must report before it is released


def exists(server: KVPool, seq_id: str) -> bool:
    answer = server.client.get(f"/v1/sequences/{seq_id}")
    assert answer.status_code in (200, 404), answer.text
    return answer.status_code == 200


def test_a_pin_is_released_only_once_every_rank_has_reported_its_load(model_dir: str, tmp_path: Path) -> None:
    server = KVPool(model_dir, PAGE)
    thread = ConnectorThread(8)
    link: KVPoolLink | None = None
    try:
        prompt = tokens(3, 4 * PAGE + 5)
        with KVPoolClient(server.url) as seeder:  # 4 pages of the prompt cached in kvpool
            seeder.create_sequence("seed")
            seeder.append("seed", token_ids=prompt[: 4 * PAGE])
            seeder.free("seed")  # (committing its full pages)
        pool = server.pool()
        geometry = Geometry(pool["num_layers"], pool["num_kv_heads"], pool["head_dim"], pool["dtype"])
        link = KVPoolLink(server.url, None, geometry, 10.0, 1.0, "scheduler")
        assert link.connect(at_start=True)
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
        thread.run(lambda: None)  # (whatever the thread had queued has run)
        assert exists(server, job.pin_id) and server.pool()["pages_used"] == 4

        def report(ranks: int) -> None:
            worker = KVPoolWorkerMeta(loaded=Counter({job.pin_id: ranks}))
            scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=worker))
            scheduler.build_connector_meta(SchedulerOutput.make_empty(), None)  # the next step
            thread.run(lambda: None)

        report(1)  # one rank of two: still held
        assert exists(server, job.pin_id) and server.pool()["pages_used"] == 4
        report(1)  # every rank: released (committing nothing new), its pages cached again
        assert not exists(server, job.pin_id)
        after = server.pool()
        assert after["pages_used"] == 0 and after["pages_cached"] == 4, after
        assert not any(k.startswith("faults") for k in link.stats), link.stats
    finally:
        thread.close()
        if link is not None:
            link.close()
        server.stop()


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
