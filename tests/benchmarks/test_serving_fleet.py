"""benchmarks/serving/fleet.py: --realtime puts kvpool's servers and redis-server (or one of them) under SCHED_FIFO;
--executor runs each engine's model in its scheduler process, pinned to its core (uni), or in vLLM CPU's worker (mp)."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.serving import fleet


def realtime_allowed() -> bool:
    return shutil.which("chrt") is not None and subprocess.run(["chrt", "-f", "1", "true"]).returncode == 0


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
@pytest.mark.skipif(not realtime_allowed(), reason="SCHED_FIFO needs root (CAP_SYS_NICE)")
def test_realtime_services_run_under_sched_fifo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = fleet.redis_service(tmp_path, 1 << 20)
    assert plain.cmd[0] == "redis-server"
    monkeypatch.setitem(fleet.PRIORITY, "redis", fleet.REALTIME)
    redis = fleet.redis_service(tmp_path, 1 << 20)
    with fleet.Fleet() as services:
        services.start([redis], timeout_s=30)
        assert redis.proc is not None
        pid = redis.proc.pid
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}/comm").read_text().strip() != "redis-server" and time.monotonic() < deadline:
            time.sleep(0.05)  # (chrt sets the policy, then becomes redis-server)
        tasks = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        assert tasks and all(os.sched_getscheduler(t) == os.SCHED_FIFO for t in tasks)
        assert os.sched_getparam(pid).sched_priority == 1


@pytest.mark.parametrize("which", [False, "both", "kvpool", "redis"])
def test_realtime_names_which_services_start_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: str | bool
) -> None:
    """--realtime [both|kvpool|redis]: the kvpool servers' and redis-server's commands start with chrt -f 1 as named
    (Redis alone ahead stands for a store on a host of its own), the others as they are."""
    monkeypatch.setattr(fleet, "PRIORITY", {"kvpool": [], "redis": []})
    fleet.set_realtime(which)
    kvpool = fleet.kvpool_service(tmp_path, "kvpool-a", tmp_path / "model", 64).cmd
    redis = fleet.redis_service(tmp_path, 1 << 20).cmd
    ahead = {name: fleet.REALTIME if which in ("both", name) else [] for name in ("kvpool", "redis")}
    assert kvpool[: len(ahead["kvpool"]) + 3] == [*ahead["kvpool"], sys.executable, "-m", "service"]
    assert redis[: len(ahead["redis"]) + 1] == [*ahead["redis"], "redis-server"]


def test_a_pinned_service_and_the_processes_it_starts_run_on_its_cores(tmp_path: Path) -> None:
    cpu = max(os.sched_getaffinity(0))
    child = "import os; print('child', sorted(os.sched_getaffinity(0)))"
    script = "import os, subprocess, sys; print('parent', sorted(os.sched_getaffinity(0)), flush=True); "
    script += f"subprocess.run([sys.executable, '-c', {child!r}])"
    service = fleet.Service("pinned", [sys.executable, "-c", script], tmp_path / "pinned.log", cores=frozenset({cpu}))
    service.start()
    assert service.proc is not None
    assert service.proc.wait(timeout=30) == 0
    assert service.log.read_text().split("\n")[:2] == [f"parent [{cpu}]", f"child [{cpu}]"]


@pytest.mark.parametrize("executor", fleet.EXECUTORS)
def test_an_engine_computes_on_its_core_with_either_executor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, executor: str
) -> None:
    """uni: vLLM's UniProcExecutor (VLLM_ENABLE_V1_MULTIPROCESSING=0 lets vLLM CPU run it), one OpenMP thread, the
    whole server pinned to the engine's core; mp: vLLM CPU's worker process, its threads bound there by vLLM."""
    monkeypatch.setitem(fleet.ENGINE, "executor", executor)
    cpus = sorted(os.sched_getaffinity(0))
    engine = fleet.vllm_service(tmp_path, "vllm-x", tmp_path / "model", 1 << 20, 256, "", core=len(cpus) - 1)
    flag = "--distributed-executor-backend"
    backend = engine.cmd[engine.cmd.index(flag) + 1] if flag in engine.cmd else None
    assert backend == ("uni" if executor == "uni" else None)
    names = ("VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")
    expected = {"uni": ("0", "1", None), "mp": (None, None, str(cpus[-1]))}[executor]
    assert tuple(engine.env.get(name) for name in names) == expected
    assert engine.cores == (frozenset({cpus[-1]}) if executor == "uni" else None)
