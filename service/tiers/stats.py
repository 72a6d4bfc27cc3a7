"""Counts of one tier (metrics read them at scrape time) and its incidents, logged once each."""

import logging
import time
from dataclasses import dataclass


@dataclass(slots=True)
class TierStats:
    hits: int = 0  # pages restored from the tier into the device
    misses: int = 0  # lookups that reached the tier and found not even the next page
    bytes_in: int = 0  # bytes read back from the tier into the device
    bytes_out: int = 0  # bytes written to the tier
    errors: int = 0  # failed reads or writes (store down, disk full, bad data on a spill tier)
    skipped: int = 0  # pages not written: queue full, or the tier down
    rejected: int = 0  # entries found but not loaded: tokens, geometry or checksum not matching
    # Seconds restores spent on the tier (wall time, waits for its threads included; PrefixCache times both):
    lookup_seconds: float = 0.0  # asking it which of a prompt's pages it holds
    load_seconds: float = 0.0  # reading those pages back into the device (K/V bytes moved, then checked)
    # Of load_seconds, the remote tier's reads on the loop waiting for bytes not there yet: the store sending them,
    # or this process's loop getting a core to take them (0 for the spill tiers, and over TLS or on a cluster).
    load_wait_seconds: float = 0.0


class Incident:
    """A tier's health: the first failure of an incident is logged (a warning), later ones only
    counted, until a success logs the recovery. While down, callers skip the tier for `backoff_s`
    after each failure, so a dead store costs requests nothing but that one timeout."""

    def __init__(self, name: str, log: logging.Logger, backoff_s: float = 1.0) -> None:
        self.name, self.log, self.backoff_s = name, log, backoff_s
        self.down = False
        self.retry_at = 0.0
        self.count = 0  # incidents so far

    def usable(self) -> bool:
        return not self.down or time.monotonic() >= self.retry_at

    def failed(self, stats: TierStats, exc: BaseException) -> None:
        stats.errors += 1
        self.retry_at = time.monotonic() + self.backoff_s
        if not self.down:
            self.down = True
            self.count += 1
            self.log.warning("%s tier failing, going on without it until it works again: %r", self.name, exc)

    def succeeded(self) -> None:
        if self.down:
            self.down = False
            self.log.warning("%s tier works again", self.name)
