"""The Python client of kvpool's HTTP API, and the pool mapped into the caller's process."""

from service.client.calls import AppendResult, SequenceInfo, StepResult
from service.client.clients import AsyncKVPoolClient, KVPoolClient
from service.ipc.attach import AttachedPool, PoolLost
from service.wire.errors import error_from_envelope

__all__ = [
    "AppendResult",
    "AsyncKVPoolClient",
    "AttachedPool",
    "KVPoolClient",
    "PoolLost",
    "SequenceInfo",
    "StepResult",
    "error_from_envelope",
]
