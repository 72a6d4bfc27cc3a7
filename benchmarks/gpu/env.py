"""The machine the figures come from, and what ran: the card, the versions, the compiled core or its source."""

import importlib.metadata
import os
import platform
import shutil

import torch

from benchmarks.gpu.report import Report
from benchmarks.report import machine

PACKAGES = ["torch", "triton", "numpy", "fastapi", "starlette", "uvicorn", "pydantic", "httpx", "redis", "pytest"]


def run(report: Report, device: torch.device) -> None:
    import service.core

    env: dict[str, object] = {"python": platform.python_version(), "device": str(device), "machine": machine()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {"card": props.name, "sms": props.multi_processor_count, "memory_GiB": round(props.total_memory / 2**30)}
        env["l2_MB"] = round(getattr(props, "L2_cache_size", 0) / 1e6)
    for name in PACKAGES:
        try:
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            env[name] = None
    # run.sh builds the core there; without OpenSSL's headers (or a compiler) it runs from its Python source.
    env["core_compiled"] = service.core.compiled_modules()
    env["core"] = "compiled" if service.core.is_compiled() else "python source"
    env["redis_server"] = shutil.which("redis-server") or shutil.which("valkey-server")
    env["carried_wheels"] = os.environ.get("KVPOOL_GPU_SITE", "")
    report.data["env"] = env
    for key, value in env.items():
        report.say(f"  {key}: {value}")
