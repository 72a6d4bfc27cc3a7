"""An index kept from the events alone always equals the prefix index: random creates, appends
(with and without ids, written or not), forks, frees, evictions and resets on a tiny pool, every
event encoded, decoded with vLLM's KVEventBatch (or kvpool's declaration) and checked exactly:
each hash recomputed from its parent (or its tenant's root, named by the tag) and its token ids."""

from typing import Any

import hypothesis.strategies as st
import msgspec
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from service.core.allocator import PageAllocator
from service.core.errors import OutOfPages
from service.core.hashing import page_hash, root_hash, token_bytes
from service.core.sequences import SequenceTable
from service.events.listener import EventListener, EventMaker, tenant_tag
from service.events.wire import EventBatch
from tests.events.conftest import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

PAGE = 2
ROOTS = {(t, s): root_hash(t, s) for t in ("", "t") for s in ("", "salt")}
TAGS = {tenant_tag(root): root for root in ROOTS.values()}
tokens = st.lists(st.integers(0, 2), max_size=7)  # a tiny vocabulary: prefixes repeat often


class EventsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.allocator = PageAllocator(8, content_names=True)
        self.table = SequenceTable(self.allocator, PAGE)
        self.queue: list[Any] = []
        self.allocator.add_listener(EventListener(self.queue.append))
        self.make = EventMaker(PAGE, "CPU", "bytes")
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.index: set[bytes] = set()
        self.ever: set[bytes] = set()  # every hash ever stored: a run's parent is one of them
        self.seqs: dict[str, str] = {}  # seq_id -> tenant
        self.next_id = 0
        self.num_events = 0

    def pick(self, i: int) -> tuple[str, str]:
        seq_id = sorted(self.seqs)[i % len(self.seqs)]
        return seq_id, self.seqs[seq_id]

    @precondition(lambda self: len(self.seqs) < 6)
    @rule(tenant=st.sampled_from(["", "t"]), salt=st.sampled_from(["", "salt"]), prompt=tokens)
    def create(self, tenant: str, salt: str, prompt: list[int]) -> None:
        self.next_id += 1
        try:
            seq = self.table.create(f"s{self.next_id}", prompt, tenant, cache_salt=salt)
        except OutOfPages:
            return
        self.seqs[seq.seq_id] = tenant

    @precondition(lambda self: self.seqs)
    @rule(
        i=st.integers(0, 9),
        ids=tokens.filter(bool),
        known=st.sampled_from([True, True, True, False]),
        written=st.booleans(),
    )
    def append(self, i: int, ids: list[int], known: bool, written: bool) -> None:
        seq_id, tenant = self.pick(i)
        try:
            self.table.append(seq_id, len(ids), ids if known else None, written, tenant)
        except OutOfPages:
            pass

    @precondition(lambda self: self.seqs and len(self.seqs) < 6)
    @rule(i=st.integers(0, 9))
    def fork(self, i: int) -> None:
        seq_id, tenant = self.pick(i)
        self.next_id += 1
        try:
            self.seqs[self.table.fork(seq_id, f"s{self.next_id}", tenant).seq_id] = tenant
        except OutOfPages:
            pass

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 9))
    def free(self, i: int) -> None:
        seq_id, tenant = self.pick(i)
        self.table.free(seq_id, tenant)
        del self.seqs[seq_id]

    @rule()
    def reset(self) -> None:
        self.allocator.reset_cache()

    @invariant()
    def index_from_events_equals_the_prefix_index(self) -> None:
        if self.queue:
            batch = EventBatch(ts=1.0, events=[self.make(item) for item in self.queue], data_parallel_rank=0)
            self.queue.clear()
            for event in self.decoder.decode(self.encoder.encode(batch)).events:
                self.apply(event)
        registered = {self.allocator.page_name(p) for p in range(self.allocator.num_pages)} - {None}
        assert self.index == registered

    def apply(self, event: Any) -> None:
        self.num_events += 1
        if isinstance(event, BlockStored):
            assert (
                event.block_size == PAGE and event.medium == "CPU" and len(event.extra_keys) == len(event.block_hashes)
            )
            assert len(event.token_ids) == PAGE * len(event.block_hashes)
            if event.parent_block_hash is None:  # a chain start: the tag names its root
                (tag,) = event.extra_keys[0]
                parent = TAGS[tag]
            else:
                assert event.extra_keys[0] is None and event.parent_block_hash in self.ever
                parent = event.parent_block_hash
            assert event.extra_keys[1:] == [None] * (len(event.block_hashes) - 1)
            for i, h in enumerate(event.block_hashes):
                parent = page_hash(parent, token_bytes(event.token_ids[i * PAGE : (i + 1) * PAGE]))
                assert h == parent and h not in self.index
            self.index.update(event.block_hashes)
            self.ever.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= self.index and len(set(event.block_hashes)) == len(event.block_hashes)
            self.index.difference_update(event.block_hashes)
        else:
            assert isinstance(event, AllBlocksCleared)
            self.index.clear()


def test_events_machine() -> None:
    run_state_machine_as_test(
        EventsMachine,
        settings=settings(
            max_examples=500, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
        ),
    )
