"""Sequences: allocate, inspect, append, fork, free."""

from typing import Annotated, Any

import torch
from fastapi import Path, Query, Request
from starlette.responses import Response

from service.core.sequences import Sequence
from service.pool import PoolState
from service.server.bodies import read_json, read_optional_json
from service.server.kv_input import decode_kv_input, kv_nbytes
from service.server.leases import renewed_if_refused
from service.server.routes.table import RouteTable
from service.server.state import StateDep, TenantDep, json_response
from service.wire.models import (
    SEQ_ID_PATTERN,
    AppendOut,
    AppendRequest,
    CreateSequence,
    ForkSequence,
    FreeOut,
    SequenceOut,
    error_responses,
)

routes = RouteTable(tags=["sequences"])
SeqIdPath = Annotated[str, Path(pattern=SEQ_ID_PATTERN)]
# ?instance=true: the answer also names the server's instance_id (a client that maps the pool checks with it
# that the pages it reads or writes are this server's, without a second call to /v1/pool).
InstanceQuery = Annotated[bool, Query(description="also answer the server's instance_id")]
# ?commit=false: the pages of the sequence not committed yet are released uncommitted (a client that could not
# write them all says so, and no prefix ever hits them).
CommitQuery = Annotated[bool, Query(description="commit the sequence's full pages not committed yet")]
ERRORS = error_responses(401, 404, 409, 413, 422, 429, 507)


def sequence_body(pool: PoolState, seq: Sequence, instance: bool = False) -> dict[str, Any]:
    """A sequence as SequenceOut describes it (instance: with the server's instance_id)."""
    body = {
        "seq_id": seq.seq_id,
        "length": pool.sequences.length(seq),
        "block_table": pool.sequences.block_table(seq),
        "cached_tokens": seq.cached_tokens,
    }
    if seq.ttl_s:  # leased sequences only, so bodies without a lease keep their shape
        body["ttl_s"] = seq.ttl_s
        body["expires_in_s"] = pool.sequences.expires_in(seq, pool.sequences.clock())
    if instance:
        body["instance_id"] = pool.instance_id
    return body


@routes.post("/v1/sequences", body=CreateSequence, status_code=201, response_model=SequenceOut, responses=ERRORS)
async def create_sequence(
    request: Request, pool: StateDep, tenant: TenantDep, instance: InstanceQuery = False
) -> Response:
    """Allocate a sequence; with token_ids it starts on the longest cached prefix of full pages (and with
    reserve_to, goes on with slots for the rest of those token ids, where pages allow)."""
    body = await read_json(request, CreateSequence)
    ttl_s = pool.settings.default_ttl_s if body.ttl_s is None else body.ttl_s
    seq = await pool.create_sequence(body.seq_id, body.token_ids, tenant, ttl_s, body.cache_salt or "", body.reserve_to)
    return json_response(sequence_body(pool, seq, instance), 201)


@routes.get("/v1/sequences/{seq_id}", response_model=SequenceOut, responses=ERRORS)
async def get_sequence(
    seq_id: SeqIdPath, pool: StateDep, tenant: TenantDep, instance: InstanceQuery = False
) -> Response:
    """Length and block table of a sequence."""
    return json_response(sequence_body(pool, pool.sequences.get(seq_id, tenant), instance))


@routes.post("/v1/sequences/{seq_id}/append", body=AppendRequest, response_model=AppendOut, responses=ERRORS)
async def append_tokens(
    seq_id: SeqIdPath, request: Request, pool: StateDep, tenant: TenantDep, instance: InstanceQuery = False
) -> Response:
    """Append tokens: new slots for each, and with k/v their data written into every layer."""
    with renewed_if_refused(pool, tenant, (seq_id,)):
        body = await read_json(request, AppendRequest)
        s = pool.settings
        kv = decode_kv_input(pool, body.k, body.v, [s.num_layers, body.num_tokens])
        seq, ext = pool.sequences.append(seq_id, body.num_tokens, body.token_ids, kv is not None, tenant)

    def write_appended() -> None:  # on the device worker: copy-on-write of a shared last page, then the K/V
        pool.engine.copy_pages(ext.copies)
        if kv is not None:
            pool.engine.write(kv[0], kv[1], torch.from_numpy(ext.slots))

    # The answer describes the sequence as this append left it, whatever requests run while the device works.
    answer = {**sequence_body(pool, seq, instance), "slots": ext.slots.tolist()}
    if ext.copies or kv is not None:  # submitted with no await since the bookkeeping: device work keeps its order
        nbytes = len(ext.copies) * s.page_nbytes + kv_nbytes(kv)
        await pool.engine.submit(write_appended, pool.engine.fits_inline(nbytes=nbytes))
    return json_response(answer)


@routes.post(
    "/v1/sequences/{seq_id}/fork",
    body=ForkSequence,
    body_required=False,
    status_code=201,
    response_model=SequenceOut,
    responses=ERRORS,
)
async def fork_sequence(seq_id: SeqIdPath, request: Request, pool: StateDep, tenant: TenantDep) -> Response:
    """A new sequence sharing the parent's pages; a shared partial last page is copied on write."""
    with renewed_if_refused(pool, tenant, (seq_id,)):
        body = await read_optional_json(request, ForkSequence)
        child = pool.sequences.fork(seq_id, body.seq_id if body else None, tenant)
    return json_response(sequence_body(pool, child), 201)


@routes.delete("/v1/sequences/{seq_id}", response_model=FreeOut, responses=ERRORS)
async def free_sequence(seq_id: SeqIdPath, pool: StateDep, tenant: TenantDep, commit: CommitQuery = True) -> Response:
    """Free a sequence; its full written pages stay cached for prefix reuse (commit=false: only those
    committed before)."""
    freed = pool.sequences.free(seq_id, tenant, commit)
    return json_response({"seq_id": seq_id, "freed_pages": freed})
