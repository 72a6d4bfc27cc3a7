"""Issue 24, item 6: huge finite inputs used to answer NaN with 200 (q = 1e38 attended to NaN; k = v = 1e38 were
accepted by append and a later attend returned non-finite output). Now an attend whose output is not finite is
refused with 422 `non_finite_output`, naming the sequences and the cause, and K/V it came with are put back as
they were. Plain, FP8 and MLA pools, each against a real `kvpool serve`.
"""

from typing import Any

import numpy as np
import pytest
import torch

from tests.conftest import dec, enc
from tests.e2e.test_input_rules import pool_state, refused

FP8 = {"KVPOOL_DTYPE": "float8_e4m3fn", "KVPOOL_QUANT_GRANULARITY": "8"}
MLA = {"KVPOOL_MLA": "true", "KVPOOL_NUM_KV_HEADS": "1", "KVPOOL_HEAD_DIM": "40", "KVPOOL_KV_LORA_RANK": "32"}
HUGE = 1e38  # finite in float32; q . k over 16+ channels of it is not


@pytest.mark.parametrize("kind", ["plain", "fp8", "mla"])
def test_an_attend_whose_output_is_not_finite_is_refused_and_writes_nothing(start_server: Any, kind: str) -> None:
    env = {"plain": {}, "fp8": FP8, "mla": MLA}[kind]
    c = start_server(env).client
    mla = kind == "mla"
    heads, dim, q_heads = (1, 40, 2) if mla else (2, 16, 4)
    rng = np.random.default_rng(24)

    def rand(*shape: int, low: float = -1.0) -> torch.Tensor:
        return torch.from_numpy(rng.uniform(low, 1.0, shape).astype(np.float32))

    def kv_body(k: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
        return {"k": enc(k)} if mla else {"k": enc(k), "v": enc(v)}

    for seq_id in ("s", "t"):
        assert c.post("/v1/sequences", json={"seq_id": seq_id}).status_code == 201
        body = {"num_tokens": 5, **kv_body(rand(2, 5, heads, dim), rand(2, 5, heads, dim))}
        assert c.post(f"/v1/sequences/{seq_id}/append", json=body).status_code == 200
    q = rand(2, q_heads, dim)
    both = {"layer": 0, "seq_ids": ["s", "t"], "q": enc(q)}
    first = c.post("/v1/attend", json=both)
    assert first.status_code == 200 and torch.isfinite(dec(first.json()["out"])).all()
    before = pool_state(c, ["s", "t"])

    # q = 1e38 for t's query: refused, naming t only and the cause.
    huge_q = q.clone()
    huge_q[1] = HUGE
    error = refused(c.post("/v1/attend", json={**both, "q": enc(huge_q)}), "non_finite_output")
    assert error["details"] == {"layer": 0, "seq_ids": ["t"]}
    assert "overflow float32 (max |q| 1e+38)" in error["message"] and "nothing was written" in error["message"]

    # k = v = 1e38 written by the attend itself at s's last position, with q > 0.5: every score overflows.
    # Refused, and s's last position holds what it held: the next attend answers exactly as the first.
    positive_q = rand(1, q_heads, dim, low=0.5)
    huge_kv = kv_body(torch.full((1, heads, dim), HUGE), torch.full((1, heads, dim), HUGE))
    error = refused(
        c.post("/v1/attend", json={"layer": 0, "seq_ids": ["s"], "q": enc(positive_q), **huge_kv}),
        "non_finite_output",
    )
    assert error["details"]["seq_ids"] == ["s"]
    assert pool_state(c, ["s", "t"]) == before
    assert c.post("/v1/attend", json=both).json()["out"] == first.json()["out"]

    # k = v = 1e38 appended: finite input, accepted; the attend over them is refused.
    assert c.post("/v1/sequences", json={"seq_id": "u"}).status_code == 201
    body = {"num_tokens": 3, **kv_body(torch.full((2, 3, heads, dim), HUGE), torch.full((2, 3, heads, dim), HUGE))}
    assert c.post("/v1/sequences/u/append", json=body).status_code == 200
    over_u = {"layer": 1, "seq_ids": ["u"], "q": enc(positive_q)}
    assert refused(c.post("/v1/attend", json=over_u), "non_finite_output")["details"] == {"layer": 1, "seq_ids": ["u"]}

    # Large values whose scores stay finite are still answered.
    r = c.post("/v1/attend", json={**both, "q": enc(q * 1e18)})
    assert r.status_code == 200 and torch.isfinite(dec(r.json()["out"])).all()
