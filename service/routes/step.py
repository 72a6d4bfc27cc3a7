"""One round trip per model step: appends for many sequences, then their lookup table."""

from fastapi import APIRouter
from starlette.responses import Response

from service.routing import ORJSONRoute
from service.schemas import StepOut, StepRequest, error_responses
from service.state import StateDep, TenantDep, json_response
from service.tensors import encode_array

router = APIRouter(prefix="/v1", tags=["step"], route_class=ORJSONRoute)


@router.post("/step", response_model=StepOut, responses=error_responses(401, 404, 413, 422, 429, 507))
async def step(body: StepRequest, pool: StateDep, tenant: TenantDep) -> Response:
    """All appends or none, then the sentinel-filled lookup table of the listed sequences."""
    appends = [(a.seq_id, a.num_tokens, a.token_ids) for a in body.appends]
    result = pool.sequences.step(appends, body.seq_ids, tenant)
    pool.engine.copy_pages(result.copies)
    cache_lengths = result.cache_lengths
    return json_response(
        {
            "lookup_table": encode_array(result.lookup_table, "uint32"),
            "cache_lengths": encode_array(cache_lengths, "uint32"),
            "input_lengths": result.input_lengths,
            "max_prompt_length": max(result.input_lengths, default=0),
            "max_cache_length": int(cache_lengths.max()) if len(cache_lengths) else 0,
            "sentinel": pool.sequences.sentinel,
            "slots": result.slots,
        }
    )
