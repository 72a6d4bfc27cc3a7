"""kvpool as a vLLM connector sees it: bookkeeping over HTTP, K/V through the mapped pool, faults absorbed.

kvpool is a cache to vLLM: when it is unreachable, restarted (a new instance_id), out of pages or
refuses a call, the connector answers "nothing cached" / skips the save and vLLM computes. Each kind
of fault is logged once per incident (until a call succeeds again) and counted in `stats`; while
an incident lasts, calls are skipped for `retry_interval_s` so that a dead server does not cost every
step a connection timeout. Configuration errors (geometry mismatch, a key without IPC rights) are
not faults: they raise, so that vLLM refuses to start with the message.
"""

import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import torch

from service.client import AttachedPool, KVPoolClient, SequenceInfo
from service.core.errors import KVPoolError, SequenceNotFound

logger = logging.getLogger("service.integrations.vllm")
T = TypeVar("T")


@dataclass(frozen=True)
class Geometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_lora_rank: int = 0  # MLA: one latent of head_dim = kv_lora_rank + rope channels per token (1 KV head)

    def describe(self) -> str:
        mla = f" (MLA, kv_lora_rank {self.kv_lora_rank})" if self.kv_lora_rank else ""
        return f"{self.num_layers} layers x {self.num_kv_heads} KV heads x head_dim {self.head_dim}, {self.dtype}{mla}"


class GeometryMismatch(ValueError):
    pass


class KVPoolLink:
    def __init__(
        self,
        url: str,
        api_key: str | None,
        model: Geometry,
        timeout_s: float,
        retry_interval_s: float,
        side: str,
    ) -> None:
        """side: "scheduler" or "worker" (which maps the pool)."""
        self.url, self.model, self.side = url, model, side
        self.attach = side == "worker"
        self.retry_interval_s = retry_interval_s
        self.client = KVPoolClient(url, api_key, timeout=timeout_s)
        self.stats: Counter[str] = Counter()
        self.pool: AttachedPool | None = None  # the mapped pool (worker side), of instance self.instance_id
        self.instance_id: str | None = None
        self.page_size = 0
        self._faults: set[str] = set()  # kinds of fault in the current incident (logged once each)
        self._retry_at = 0.0
        self.disabled = ""  # why the link is off for good (a mismatch found after start)
        self._orphans: set[str] = set()

    # -- connecting ---------------------------------------------------------------------------
    def connect(self, at_start: bool) -> bool:
        """Check the pool's geometry (and map it, on the worker side). True when usable now."""
        try:
            pool = self.client.pool()
            self.check_geometry(pool)
            mapped = self.client.attach() if self.attach else None
            if mapped is not None and mapped.device.type == "cpu":
                # Fault the mapping in now (one read per 4 KiB page), not during the first loads and saves.
                raw = mapped.blocks.view(-1).view(torch.uint8)  # (FP8 has no sum on the CPU)
                raw[::4096].sum()
        except (GeometryMismatch, KVPoolError) as exc:
            status = getattr(exc, "status", 0)
            if isinstance(exc, GeometryMismatch) or status in (401, 403):
                if at_start:
                    raise
                self.disabled = str(exc)
                logger.error("kvpool connector disabled: %s", exc)
                return False
            self.fault("error", exc)
            return False
        except (httpx.HTTPError, OSError) as exc:
            self.fault("unreachable", exc)
            return False
        if self.instance_id is not None and pool["instance_id"] != self.instance_id:
            self.fault("restarted", f"instance {self.instance_id} -> {pool['instance_id']}")
        self.instance_id, self.page_size = pool["instance_id"], int(pool["page_size"])
        if self.pool is not None:
            self.pool.close()
        self.pool = mapped
        self.recovered()
        return True

    def check_geometry(self, pool: dict[str, Any]) -> None:
        rank = int(pool.get("kv_lora_rank") or 0) if pool.get("mla") else 0
        have = Geometry(
            int(pool["num_layers"]), int(pool["num_kv_heads"]), int(pool["head_dim"]), str(pool["dtype"]), rank
        )
        if have != self.model:
            raise GeometryMismatch(
                f"kvpool at {self.url} holds {have.describe()}, "
                f"but the vLLM model's KV cache is {self.model.describe()}: start kvpool with "
                "`kvpool serve --model <the model's directory>` (or KVPOOL_NUM_LAYERS, ..._NUM_KV_HEADS, "
                "..._HEAD_DIM, ..._DTYPE, ..._MLA) to match"
            )

    def usable(self) -> bool:
        """Connected now, or reconnected if the retry interval has passed."""
        if self.disabled:
            return False
        if self.instance_id is not None and not self._faults:
            return True
        if time.monotonic() < self._retry_at:
            return False
        return self.connect(at_start=False)

    # -- faults -------------------------------------------------------------------------------
    def fault(self, kind: str, detail: object) -> None:
        self.stats[f"faults_{kind}"] += 1
        if kind not in self._faults:
            self._faults.add(kind)
            self.stats["incidents"] += 1
            logger.warning(
                "kvpool %s (%s): %s; vLLM computes what it cannot load, retrying every %.1f s",
                kind,
                self.side,
                detail,
                self.retry_interval_s,
            )
        # A restart is a live server: map the new pool at the next call rather than after a wait.
        self._retry_at = 0.0 if kind == "restarted" else time.monotonic() + self.retry_interval_s

    def recovered(self) -> None:
        if self._faults:
            logger.warning(
                "kvpool is back (%s) at %s, instance %s, after: %s",
                self.side,
                self.url,
                self.instance_id,
                ", ".join(sorted(self._faults)),
            )
            self._faults.clear()
        # Creates that may have run while their answer was lost, and sequences to release uncommitted.
        for seq_id in list(self._orphans):
            try:
                self.client.free(seq_id, commit=False)
                self.stats["orphans_freed"] += 1
            except SequenceNotFound:
                pass  # the create never ran
            except (httpx.HTTPError, KVPoolError):
                continue  # kept for the next recovery
            self._orphans.discard(seq_id)

    def call(self, fn: Callable[[], T]) -> T | None:
        """fn() or, on a fault, None (logged and counted). A restart found here is handled by the next usable()."""
        try:
            return fn()
        except (httpx.HTTPError, KVPoolError) as exc:
            self.record(exc)
        return None

    def record(self, exc: httpx.HTTPError | KVPoolError) -> None:
        if isinstance(exc, httpx.HTTPError):
            self.fault("unreachable", exc)
        else:
            self.fault(exc.code if exc.code in ("out_of_pages", "quota_exceeded") else "error", exc)

    # -- the calls the connector makes ----------------------------------------------------------
    def create(
        self, token_ids: list[int], cache_salt: str | None, reserve_to: int | None = None
    ) -> SequenceInfo | None:
        """A sequence on the longest cached prefix of `token_ids` (`reserve_to`: and the rest of them up to that
        many appended, where kvpool has the pages), or None (a fault).

        The id is ours, so a create whose answer is lost (a timeout: the server may still run it)
        is freed once kvpool answers again, uncommitted. ttl_s=0: no lease even where KVPOOL_DEFAULT_TTL_S is set
        (an expiry frees, and a free commits pages whose K/V a save may not have written yet).
        """
        seq_id = uuid.uuid4().hex
        try:
            return self.client.create_sequence(
                seq_id, token_ids, ttl_s=0, cache_salt=cache_salt, instance=True, reserve_to=reserve_to
            )
        except (httpx.TimeoutException, httpx.ReadError, httpx.RemoteProtocolError) as exc:
            self._orphans.add(seq_id)  # the request went out: the server may have run it
            self.record(exc)
        except (httpx.HTTPError, KVPoolError) as exc:  # refused, or never reached a server: nothing to free
            self.record(exc)
        return None

    def forget(self, seq_id: str) -> None:
        """A sequence to free, uncommitted, once kvpool answers again."""
        self._orphans.add(seq_id)

    def free(self, seq_id: str) -> bool:
        """Free a sequence, committing its pages (their K/V is written)."""
        return self.call(lambda: self.client.free(seq_id)) is not None

    def discard(self, seq_id: str) -> None:
        """Free a sequence, releasing its pages not committed yet uncommitted (now, or once kvpool answers)."""
        try:
            self.client.free(seq_id, commit=False)
        except SequenceNotFound:
            pass  # gone with a restart, or never created
        except (httpx.HTTPError, KVPoolError) as exc:
            self.record(exc)
            self._orphans.add(seq_id)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        self.client.close()
