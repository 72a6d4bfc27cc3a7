"""Attention over the pool for the last q_len positions of each sequence."""

import time

import torch
from fastapi import APIRouter
from starlette.responses import Response

from service.core.errors import InvalidRequest
from service.server.kv_input import decode_kv_input
from service.server.metrics import MetricsDep
from service.server.routing import ORJSONRoute
from service.server.state import StateDep, TenantDep, json_response
from service.wire.models import AttendOut, AttendRequest, error_responses
from service.wire.tensors import decode, encode

router = APIRouter(prefix="/v1", tags=["attention"], route_class=ORJSONRoute)


@router.post("/attend", response_model=AttendOut, responses=error_responses(401, 404, 413, 422))
async def attend(body: AttendRequest, pool: StateDep, tenant: TenantDep, metrics: MetricsDep) -> Response:
    """Causal paged attention (GQA) of q against each sequence, optionally writing k/v first."""
    s = pool.settings
    if body.layer >= s.num_layers:
        raise InvalidRequest(f"layer {body.layer} is out of range: the pool has {s.num_layers} layers")
    shape = body.q.shape
    if len(shape) != 3 or shape[2] != s.head_dim or shape[1] == 0 or shape[1] % s.num_kv_heads:
        raise InvalidRequest(
            f"q must have shape [T, num_q_heads, {s.head_dim}] with num_q_heads a multiple of "
            f"num_kv_heads={s.num_kv_heads}, not {shape}"
        )
    if not body.q.dtype.startswith(("float", "bfloat")):
        raise InvalidRequest(f"q must be a floating-point tensor, not {body.q.dtype}")
    q_lens = body.q_lens or [1] * len(body.seq_ids)
    if sum(q_lens) != shape[0]:
        raise InvalidRequest(f"q has {shape[0]} tokens but q_lens add up to {sum(q_lens)}")
    q = decode("q", body.q.dtype, shape, body.q.data)
    kv = decode_kv_input(pool, body.k, body.v, [shape[0]])
    lut, cache_lengths, slots = pool.sequences.attention_batch(body.seq_ids, q_lens, tenant)
    query_start_loc = torch.tensor([0, *q_lens], dtype=torch.int64).cumsum(0)
    kernel = "decode" if max(q_lens, default=1) == 1 else "prefill"

    def device_work() -> torch.Tensor:  # on the engine's worker: the wait for the device stays off the loop
        if kv is not None:
            pool.engine.write(kv[0], kv[1], torch.from_numpy(slots), layer=body.layer)
        attention_started = time.perf_counter()
        out = pool.engine.attend(
            q,
            body.layer,
            torch.from_numpy(lut.astype("int64")),
            torch.from_numpy(cache_lengths),
            query_start_loc,
            scale=body.scale,
            sliding_window=body.sliding_window,
            softcap=body.softcap,
        )
        metrics.observe_attention(kernel, pool.engine.backend, attention_started)
        return out.cpu()

    out = await pool.engine.submit(device_work)
    return json_response({"out": encode(out)})
