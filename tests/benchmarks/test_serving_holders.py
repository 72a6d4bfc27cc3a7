"""benchmarks.serving.holders: each routed request classed by where its prompt was held when the proxy sent it."""

import random

import pytest

from benchmarks.serving.holders import by_holder, classify


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(10_000)}" for _ in range(n))


def completion(prompt: str, backend: int, first_byte_s: float, route_s: float = 0.0) -> dict:
    return {"body": {"prompt": prompt}, "backend": backend, "first_byte_s": first_byte_s, "route_s": route_s}


def test_a_prefix_is_a_miss_first_then_local_where_it_ran_and_restored_elsewhere() -> None:
    shared, other = words(1, 500), words(2, 500)
    lines = [
        completion(shared + " " + words(10, 30), 0, 0.150, 0.002),  # nobody holds it: computed on node 0
        completion(shared + " " + words(11, 30), 1, 0.040, 0.001),  # node 1 does not: restored there
        completion(shared + " " + words(12, 30), 0, 0.020, 0.002),  # node 0 does
        completion(shared + " " + words(13, 30), 1, 0.030, 0.003),  # and now node 1 as well
        completion(other + " " + words(14, 30), 1, 0.160, 0.004),  # another prefix: a miss wherever it goes
    ]
    assert classify(lines) == ["miss", "restored", "local", "local", "miss"]
    result = by_holder(lines)
    assert result["miss"] == {"requests": 2, "first_byte_p50_ms": pytest.approx(155.0), "route_ms_mean": 3.0}
    assert result["local"] == {"requests": 2, "first_byte_p50_ms": pytest.approx(25.0), "route_ms_mean": 2.5}
    assert result["restored"] == {"requests": 1, "first_byte_p50_ms": pytest.approx(40.0), "route_ms_mean": 1.0}


def test_a_prompt_sharing_less_than_half_with_an_earlier_one_is_not_held() -> None:
    system = words(3, 100)
    lines = [
        completion(system + " " + words(20, 300), 0, 0.1),  # shares a short system prompt only
        completion(system + " " + words(21, 300), 0, 0.1),
        completion(system + " " + words(21, 300) + " " + words(22, 200), 1, 0.1),  # 400 of 600 words: held
    ]
    assert classify(lines) == ["miss", "miss", "restored"]


def test_a_conversations_next_round_is_held_by_the_node_that_served_the_last() -> None:
    history = [{"role": "system", "content": words(4, 100)}, {"role": "user", "content": words(5, 400)}]
    later = [*history, {"role": "assistant", "content": words(6, 16)}, {"role": "user", "content": words(7, 20)}]
    rounds = [
        {"body": {"messages": history}, "backend": 1, "first_byte_s": 0.2, "route_s": 0.0},
        {"body": {"messages": later}, "backend": 1, "first_byte_s": 0.03, "route_s": 0.0},
        {"body": {"messages": later}, "backend": 0, "first_byte_s": 0.05, "route_s": 0.0},
    ]
    assert classify(rounds) == ["miss", "local", "restored"]
    assert by_holder([])["local"] == {"requests": 0, "first_byte_p50_ms": None, "route_ms_mean": None}
