"""The worker side's report of finished requests (get_finished): a request that finished in the last step and whose
last pages this step saves (KVPoolMetadata.finish_saved) is reported only once this step's saves are queued and
done, in both orders vLLM calls the worker in (wait_for_save then get_finished; or, with a draft model's
deferred finalize, get_finished first)."""

from collections import Counter

import pytest

pytest.importorskip("vllm")

from vllm.config import VllmConfig

from service.integrations.kvpool_link import Geometry, KVPoolLink
from service.integrations.vllm_metadata import KVPoolMetadata
from service.integrations.vllm_thread import ConnectorThread
from service.integrations.vllm_worker import KVPoolConnectorWorker


@pytest.mark.parametrize("deferred_finalize", [False, True])
def test_a_finished_request_is_reported_once_the_step_that_saves_its_last_pages_has(deferred_finalize: bool) -> None:
    thread = ConnectorThread(8)
    link = KVPoolLink("http://127.0.0.1:9", None, Geometry(2, 2, 64, "float32"), 1.0, 1.0, "worker")
    try:
        worker = KVPoolConnectorWorker(VllmConfig(), link, thread, Counter(), 16)
        # Its last pages gave no save job (kvpool held them already): nothing is pending for it.
        meta = KVPoolMetadata(finish_saved={"r"})
        worker.start_load_kv(meta)
        if deferred_finalize:
            assert worker.get_finished({"r"}) == (None, None)  # (before wait_for_save has seen this step)
            worker.wait_for_save(meta)
            assert worker.get_finished(set()) == ({"r"}, None)
        else:
            worker.wait_for_save(meta)
            assert worker.get_finished({"r"}) == ({"r"}, None)
        assert worker.get_finished(set()) == (None, None)  # reported once
    finally:
        thread.close()
        link.close()
