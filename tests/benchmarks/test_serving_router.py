"""benchmarks/serving/router.py: a node's cost for a prompt, as the prefix policies weigh it."""

from pathlib import Path

from benchmarks.serving.fleet import router_service
from benchmarks.serving.router import costs


def test_without_a_shared_tier_only_what_a_node_holds_is_not_computed() -> None:
    assert costs(1000, [900, 0], [0, 0], shared_tier=False, restore_weight=0.1) == [100, 1000]


def test_the_requests_in_flight_count_by_their_prompts() -> None:
    # The holder serves a 1,000-token prompt: the prompt goes to the idle node, which computes it all.
    assert costs(1000, [900, 0], [1000, 0], shared_tier=False, restore_weight=0.1) == [1100, 1000]
    assert costs(1000, [900, 0], [800, 0], shared_tier=False, restore_weight=0.1) == [900, 1000]


def test_with_a_shared_tier_every_node_restores_what_any_node_holds() -> None:
    # Node 1 computes the same 100 tokens as node 0 and restores node 0's 900 at a tenth of their cost.
    assert costs(1000, [900, 0], [0, 0], shared_tier=True, restore_weight=0.1) == [100, 190]
    assert costs(1000, [900, 0], [1000, 0], shared_tier=True, restore_weight=0.1) == [1100, 190]
    assert costs(1000, [900, 600], [0, 0], shared_tier=True, restore_weight=0.5) == [100, 250]


def test_a_match_longer_than_the_prompt_counts_as_the_whole_prompt() -> None:
    assert costs(100, [160, 0], [0, 0], shared_tier=True, restore_weight=0.1) == [0, 10]
    assert costs(100, [160, 0], [0, 0], shared_tier=False, restore_weight=0.1) == [0, 100]


def test_a_true_option_is_passed_as_a_flag(tmp_path: Path) -> None:
    service = router_service(tmp_path, "r", ["http://a", "http://b"], "match", kvpools="k1,k2", shared_tier=True)
    assert service.cmd[-3:] == ["--kvpools", "k1,k2", "--shared-tier"]
