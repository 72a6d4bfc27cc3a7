"""Pure bookkeeping: allocator, sequences, lookup tables, errors (stdlib + numpy only).

The per-page loops (page_ops, batching, prefix_index) are compiled by Cython from their own .py
files when the package is built; compiled_modules() says whether this process runs that build (for
the server's start-up log and GET /v1/pool). Without it the same files run as plain Python (with the
`cython` package installed for its decorators): correct, but 10 to 200 times slower. Nothing is
imported here, so `service.core.errors` (which the client and the wire import) loads no loop module.
"""

import functools
import importlib

LOOP_MODULES = (
    "service.core.page_ops",
    "service.core.batching",
    "service.core.lru",
    "service.core.probe_hash",
    "service.core.prefix_index",
    "service.core.token_ids",
)


@functools.cache  # (the build does not change while the process runs)
def compiled_modules() -> dict[str, bool]:
    """{module: runs compiled} for each of the core's loop modules."""
    return {name: bool(importlib.import_module(name).COMPILED) for name in LOOP_MODULES}


def is_compiled() -> bool:
    return all(compiled_modules().values())
