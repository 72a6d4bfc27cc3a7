"""The options every attention entry point takes, kernels and references alike: one TypedDict, read in one place.

An entry point declares `**options: Unpack[AttendOptions]` and reads them with `attend_options`, which refuses
a name that is not an option as Python would refuse an unknown keyword argument.
"""

import math
from typing import TypedDict


class AttendOptions(TypedDict, total=False):
    scale: float | None  # None: 1 / sqrt(head_dim)
    sliding_window: int | None  # W: a query at position p sees (p - W, p]
    softcap: float | None  # c: logits become c * tanh(s / c)


OPTION_NAMES = frozenset(AttendOptions.__annotations__)


def attend_options(options: AttendOptions, head_dim: int) -> tuple[float, int | None, float | None]:
    """(scale with its default applied, sliding_window, softcap)."""
    unknown = sorted(set(options) - OPTION_NAMES)
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r} (the attention options: {sorted(OPTION_NAMES)})")
    scale = options.get("scale")
    return (
        1.0 / math.sqrt(head_dim) if scale is None else scale,
        options.get("sliding_window"),
        options.get("softcap"),
    )
