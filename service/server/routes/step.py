"""One round trip per model step: appends for many sequences, then their lookup table."""

from typing import Any

import numpy as np
from fastapi import Request
from starlette.responses import Response

from service.core.lut_formats import flash_attn_tables, flashinfer_tables
from service.pool import PoolState
from service.server.bodies import read_json
from service.server.leases import renew_named_in
from service.server.routes.sequences import InstanceQuery
from service.server.routes.table import RouteTable
from service.server.state import StateDep, TenantDep, json_response
from service.wire.models import StepOut, StepRequest, error_responses
from service.wire.tensors import encode_array

routes = RouteTable(tags=["step"])


@routes.post(
    "/v1/step", body=StepRequest, response_model=StepOut, responses=error_responses(401, 404, 413, 422, 429, 507)
)
async def step(request: Request, pool: StateDep, tenant: TenantDep, instance: InstanceQuery = False) -> Response:
    """All appends or none, then the sentinel-filled lookup table of the listed sequences (?instance=true: and
    the server's instance_id, for a client that writes the appended pages through its mapping of the pool),
    then the sequences in `free` freed, as DELETE would (a client's finished requests, on its next step)."""
    body = await read_json(request, StepRequest, refused=lambda raw: renew_named_in(pool, tenant, raw))
    appends = [(a.seq_id, a.num_tokens, a.token_ids) for a in body.appends]
    result = pool.sequences.step(appends, body.seq_ids, tenant, body.free)
    cache_lengths = result.cache_lengths
    answer = json_response(
        {
            "lookup_table": encode_array(result.lookup_table, "uint32"),
            "cache_lengths": encode_array(cache_lengths, "uint32"),
            "input_lengths": result.input_lengths,
            "max_prompt_length": max(result.input_lengths, default=0),
            "max_cache_length": int(cache_lengths.max()) if len(cache_lengths) else 0,
            "sentinel": pool.sequences.sentinel,
            "slots": result.new_slots.reshape(-1, 1) if result.one_token_each else result.slots,  # numpy: no lists
            "format": body.format,
            **format_tables(body.format, result.lookup_table, cache_lengths, result.input_lengths, pool),
            **({"instance_id": pool.instance_id} if instance else {}),
        }
    )
    if result.copies:  # copy-on-write, submitted with no await since the bookkeeping (device work keeps its order)
        copies = result.copies
        nbytes = len(copies) * pool.settings.page_nbytes
        await pool.engine.submit(lambda: pool.engine.copy_pages(copies), pool.engine.fits_inline(nbytes=nbytes))
    return answer


def format_tables(
    fmt: str, lut: np.ndarray, cache_lengths: np.ndarray, input_lengths: list[int], pool: PoolState
) -> dict[str, Any]:
    """FlashInfer's CSR page table or flash_attn's block_table for the same rows (nothing for max)."""
    if fmt == "max":
        return {}
    lengths = cache_lengths.astype(np.int64) + np.asarray(input_lengths, dtype=np.int64)
    page_size = pool.settings.page_size
    if fmt == "flashinfer":
        indptr, indices, last = flashinfer_tables(lut, lengths, page_size)
        return {
            "kv_indptr": encode_array(indptr, "int32"),
            "kv_indices": encode_array(indices, "int32"),
            "kv_last_page_len": encode_array(last, "int32"),
        }
    block_table, seqlens = flash_attn_tables(lut, lengths, page_size)
    return {"block_table": encode_array(block_table, "int32"), "cache_seqlens": encode_array(seqlens, "int32")}
