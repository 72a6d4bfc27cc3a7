"""The Python client of kvpool's HTTP API, and the pool mapped into the caller's process."""

from service.client.clients import (
    AppendResult,
    AsyncKVPoolClient,
    AttachedPool,
    KVPoolClient,
    PoolLost,
    SequenceInfo,
    StepResult,
    error_from_envelope,
)

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
