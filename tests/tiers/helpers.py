"""A prefix workload over HTTP: prompts whose K/V is a function of (prompt, position), written
where the pool lacks it, attended, and freed; the outputs compare bit for bit across passes/servers."""

from typing import TYPE_CHECKING, Any

import torch

from tests.conftest import dec, enc

if TYPE_CHECKING:
    from service.tiers.remote_tier import RemoteTier
    from service.tiers.spill import SpillTier

LAYERS, HEADS, DIM, PAGE = 2, 2, 16, 4  # tests.conftest.SMALL_POOL


def prompt(i: int, num_pages: int = 4) -> list[int]:
    return [1000 * i + t for t in range(num_pages * PAGE)]


def kv_of(i: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    k = torch.randn(LAYERS, length, HEADS, DIM, generator=g)
    return k, torch.randn(LAYERS, length, HEADS, DIM, generator=g)


QUERY = torch.randn(1, 2 * HEADS, DIM, generator=torch.Generator().manual_seed(7))


def run_prompt(c: Any, seq_id: str, i: int, num_pages: int = 4, headers: Any = None) -> tuple[int, list[torch.Tensor]]:
    """Create `seq_id` on prompt i (+ one more token, so every full page may hit), write what is not
    cached, attend at every layer, free. Returns (cached_tokens, outputs per layer)."""
    tokens = prompt(i, num_pages)
    r = c.post("/v1/sequences", json={"seq_id": seq_id, "token_ids": [*tokens, 7]}, headers=headers)
    assert r.status_code == 201, r.text
    cached = r.json()["cached_tokens"]
    if cached < len(tokens):
        k, v = kv_of(i, len(tokens))
        body = {"num_tokens": len(tokens) - cached, "token_ids": tokens[cached:]}
        body |= {"k": enc(k[:, cached:]), "v": enc(v[:, cached:])}
        r = c.post(f"/v1/sequences/{seq_id}/append", json=body, headers=headers)
        assert r.status_code == 200, r.text
    outs = []
    for layer in range(LAYERS):
        r = c.post("/v1/attend", json={"layer": layer, "seq_ids": [seq_id], "q": enc(QUERY)}, headers=headers)
        assert r.status_code == 200, r.text
        outs.append(dec(r.json()["out"]))
    assert c.delete(f"/v1/sequences/{seq_id}", headers=headers).status_code == 200
    return cached, outs


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b))


def spill_tier(state: Any) -> "SpillTier":
    """The PoolState's spill tier (KVPOOL_SPILL), first in its cache's order."""
    from service.tiers.spill import SpillTier

    tier = state.cache.tiers[0]
    assert isinstance(tier, SpillTier)
    return tier


def remote_tier(state: Any) -> "RemoteTier":
    """The PoolState's remote tier (KVPOOL_REMOTE_URL), last in its cache's order."""
    from service.tiers.remote_tier import RemoteTier

    tier = state.cache.tier("remote")
    assert isinstance(tier, RemoteTier)
    return tier
