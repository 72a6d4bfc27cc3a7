"""The live sequences: their records by (tenant, seq_id) and by block-table row, and their leases.

Every lookup by id renews the sequence's lease, if it has one, and renew() renews the ones a refused
call named: any call naming a sequence keeps it alive, whether or not it succeeds. Renewal is one
clock read and one float store per leased sequence named (none at all while no sequence has a
lease); finding the expired ones is a scan instead, one comparison per live sequence, run by the
sweeper about once a second. A heap would make every renewal a push on the hot path to speed up the
once-a-second path.
"""

import os
from collections.abc import Callable

import numpy as np

from service.core.errors import InvalidRequest, SequenceExists, SequenceNotFound
from service.core.records import Sequence


class Registry:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock  # expires_at is on this clock
        self.by_tenant: dict[str, dict[str, Sequence]] = {}
        self.of_row: list[Sequence | None] = []  # the sequence on each row (None: a free row)
        self.num_leased = 0
        self._num = 0

    def __len__(self) -> int:
        return self._num

    def get(self, seq_id: str, tenant: str) -> Sequence:
        seq = self.by_tenant.get(tenant, {}).get(seq_id)
        if seq is None:
            raise SequenceNotFound(seq_id)
        if seq.ttl_s:
            seq.expires_at = self.clock() + seq.ttl_s
        return seq

    def rows(self, seq_ids: list[str], tenant: str) -> np.ndarray:
        """int64 rows of `seq_ids` (one dict probe each), or SequenceNotFound for the first unknown one."""
        seqs = self.by_tenant.get(tenant, {})
        try:
            if not self.num_leased:
                return np.array([seqs[s].row for s in seq_ids], dtype=np.int64)
            found = [seqs[s] for s in seq_ids]
        except KeyError as exc:
            raise SequenceNotFound(str(exc.args[0])) from None
        now = self.clock()
        for seq in found:
            if seq.ttl_s:
                seq.expires_at = now + seq.ttl_s
        return np.array([seq.row for seq in found], dtype=np.int64)

    def renew(self, seq_ids: list[str], tenant: str) -> None:
        """Renew the leases of those of `seq_ids` the tenant has (unknown ids are skipped)."""
        if not self.num_leased:
            return
        seqs, now = self.by_tenant.get(tenant, {}), self.clock()
        for seq_id in seq_ids:
            seq = seqs.get(seq_id)
            if seq is not None and seq.ttl_s:
                seq.expires_at = now + seq.ttl_s

    def all(self) -> list[Sequence]:
        return [s for seqs in self.by_tenant.values() for s in seqs.values()]

    def new_id(self, seq_id: str | None, tenant: str) -> str:
        """`seq_id`, or SequenceExists if the tenant has it; a fresh id for None: 32 hex digits of
        os.urandom, as unguessable as uuid4().hex (the format clients have seen) at a tenth of its cost."""
        if seq_id is None:
            return os.urandom(16).hex()
        if seq_id in self.by_tenant.get(tenant, {}):
            raise SequenceExists(seq_id)
        return seq_id

    def add(self, seq: Sequence) -> None:
        seqs = self.by_tenant.get(seq.tenant)
        if seqs is None:
            seqs = self.by_tenant[seq.tenant] = {}
        seqs[seq.seq_id] = seq
        if seq.row >= len(self.of_row):
            self.of_row.extend([None] * (seq.row + 1 - len(self.of_row)))
        self.of_row[seq.row] = seq
        self._num += 1
        self.num_leased += bool(seq.ttl_s)

    def remove(self, seq: Sequence) -> None:
        del self.by_tenant[seq.tenant][seq.seq_id]
        self.of_row[seq.row] = None
        self._num -= 1
        self.num_leased -= bool(seq.ttl_s)

    def expired(self, now: float) -> list[Sequence]:
        """The leased sequences whose lease ran out by `now`, in no particular order."""
        if not self.num_leased:
            return []
        return [s for s in self.all() if s.ttl_s and s.expires_at <= now]


def check_distinct(seq_ids: list[str]) -> None:
    """InvalidRequest unless `seq_ids` are distinct: attend's and step's seq_ids name each sequence once
    (a repeated row of a table would be given the same slots twice)."""
    if len(set(seq_ids)) == len(seq_ids):
        return
    seen: set[str] = set()
    for seq_id in seq_ids:
        if seq_id in seen:
            raise InvalidRequest(f"seq_ids must be distinct: {seq_id!r} is named more than once")
        seen.add(seq_id)
