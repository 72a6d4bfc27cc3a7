"""Attention over the pool for the last q_len positions of each sequence."""

import time
from typing import Any

import numpy as np
import torch
from fastapi import Request
from starlette.responses import Response

from service.core.errors import InvalidRequest, NonFiniteOutput
from service.pool import PoolState
from service.server.bodies import read_json
from service.server.kv_input import all_finite, decode_finite, decode_kv_input, kv_nbytes
from service.server.leases import renew_named_in, renewed_if_refused
from service.server.metrics import Metrics, MetricsDep
from service.server.routes.table import RouteTable
from service.server.state import StateDep, TenantDep, json_response
from service.wire.models import AttendOut, AttendRequest, error_responses
from service.wire.tensors import encode

routes = RouteTable(tags=["attention"])


@routes.post("/v1/attend", body=AttendRequest, response_model=AttendOut, responses=error_responses(401, 404, 413, 422))
async def attend(request: Request, pool: StateDep, tenant: TenantDep, metrics: MetricsDep) -> Response:
    """Causal paged attention (GQA) of q against each sequence, optionally writing k/v first."""
    body = await read_json(request, AttendRequest, refused=lambda raw: renew_named_in(pool, tenant, raw))
    with renewed_if_refused(pool, tenant, body.seq_ids):
        return await attend_checked(body, pool, tenant, metrics)


async def attend_checked(body: AttendRequest, pool: PoolState, tenant: str, metrics: Metrics) -> Response:
    s = pool.settings
    if body.layer >= s.num_layers:
        raise InvalidRequest(f"layer {body.layer} is out of range: the pool has {s.num_layers} layers")
    shape = body.q.shape
    if len(shape) != 3 or shape[2] != s.head_dim or shape[1] == 0 or shape[1] % s.num_kv_heads:
        raise InvalidRequest(
            f"q must have shape [T, num_q_heads, {s.head_dim}] with num_q_heads a multiple of "
            f"num_kv_heads={s.num_kv_heads}, not {shape}"
        )
    q_lens = body.q_lens or [1] * len(body.seq_ids)
    if sum(q_lens) != shape[0]:
        raise InvalidRequest(f"q has {shape[0]} tokens but q_lens add up to {sum(q_lens)}")
    # The work is sized (and refused if too large) before any tensor is decoded.
    lut, cache_lengths, slots = pool.sequences.attention_batch(body.seq_ids, q_lens, tenant, pool.max_attend_tokens)
    q = decode_finite("q", body.q)
    kv = decode_kv_input(pool, body.k, body.v, [shape[0]])
    query_start_loc = torch.tensor([0, *q_lens], dtype=torch.int64).cumsum(0)
    kernel = "decode" if max(q_lens, default=1) == 1 else "prefill"

    def write_and_attend() -> dict[str, Any]:  # on the device worker, the encoding of `out` too (MBs of base64)
        slots_t = torch.from_numpy(slots)
        saved = None
        if kv is not None:  # kept to be put back if the output is refused (all-or-nothing)
            saved = pool.engine.save_slots(slots_t, body.layer)
            pool.engine.write(kv[0], kv[1], slots_t, layer=body.layer)
        started = time.perf_counter()
        out = pool.engine.attend(
            q,
            body.layer,
            torch.from_numpy(lut.astype("int64")),
            torch.from_numpy(cache_lengths),
            query_start_loc,
            scale=body.scale,
            sliding_window=body.sliding_window,
            softcap=body.softcap,
        ).to("cpu")
        metrics.observe_attention(kernel, pool.engine.backend, started)
        if not all_finite(out):  # the one check of every backend's output (plain, FP8, MLA)
            if saved is not None:
                pool.engine.restore_slots(slots_t, body.layer, saved)
            raise non_finite_output(out, q, body, q_lens)
        return encode(out)

    pairs = int((np.asarray(q_lens) * (cache_lengths + np.asarray(q_lens))).sum())  # (query, key) pairs, at most
    flops = 4 * shape[1] * s.head_dim * pairs
    inline = pool.engine.fits_inline(flops, q.nbytes + kv_nbytes(kv))
    # Submitted with no await since the bookkeeping: device work keeps its order.
    out = await pool.engine.submit(write_and_attend, inline)
    return json_response({"out": out})


def non_finite_output(out: torch.Tensor, q: torch.Tensor, body: AttendRequest, q_lens: list[int]) -> NonFiniteOutput:
    """The refusal of an output with NaN or infinite values (out: [T, Hq, *], q: [T, Hq, D]), naming the
    sequences whose rows are not finite and the size of their queries."""
    bad_rows = ~torch.isfinite(out.float()).flatten(1).all(1)  # [T]
    starts = np.cumsum([0, *q_lens])
    seq_ids = [sid for i, sid in enumerate(body.seq_ids) if bad_rows[starts[i] : starts[i + 1]].any()]
    scale = "" if body.scale is None else f", scale {body.scale:.3g}"
    cause = (
        f"the scores q . k x scale overflow float32 (max |q| {float(q.float().abs().max()):.3g}{scale}), or K/V "
        "at their positions hold values too large"
    )
    return NonFiniteOutput(body.layer, seq_ids, cause)
