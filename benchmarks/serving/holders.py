"""Where each request's prompt was held when the routing proxy sent it on, from the proxy's request log of one run.

Each request is a miss (no node had served a prompt sharing at least HELD of it, earlier in the run), local (the
node it went to had) or restored (only another node had: with a shared tier, that node's kvpool restores the
pages from the store, if they are there yet). Per class: how many, and the time to the first byte as the proxy
saw it (p50). With two nodes this is what a prefix router can win over round robin (restored requests made local)
and what it pays for it (its time choosing, `route_s`, spent on every request): docs/fleet.md, "What the load found".
"""

import json
import statistics
from typing import Any

HELD = 0.5  # an earlier prompt sharing at least this fraction of a prompt (its first characters) holds it
CLASSES = ("miss", "local", "restored")


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt as text: a completion's prompt, or a chat's messages (a later round's start with the earlier's)."""
    return json.dumps(body["prompt"] if "prompt" in body else body["messages"])


def classify(lines: list[dict[str, Any]]) -> list[str]:
    """Each logged request's class, in the log's order."""
    served: dict[int, list[str]] = {}  # node -> the prompts it was sent, as text
    classes = []
    for line in lines:
        text = prompt_text(line["body"])
        head = text[: max(1, round(HELD * len(text)))]
        held = {node for node, texts in served.items() if any(t.startswith(head) for t in texts)}
        classes.append("miss" if not held else "local" if line["backend"] in held else "restored")
        served.setdefault(line["backend"], []).append(text)
    return classes


def by_holder(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per class: requests, their p50 time to the first byte and mean time choosing a node (ms; None where none)."""
    classes = classify(lines)
    out: dict[str, dict[str, Any]] = {}
    for name in CLASSES:
        mine = [line for line, c in zip(lines, classes) if c == name]
        first = [1e3 * line["first_byte_s"] for line in mine]
        route = [1e3 * line["route_s"] for line in mine]
        out[name] = {
            "requests": len(mine),
            "first_byte_p50_ms": statistics.median(first) if first else None,
            "route_ms_mean": statistics.fmean(route) if route else None,
        }
    return out
