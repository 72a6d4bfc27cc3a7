"""Pure bookkeeping: allocator, sequences, lookup tables, errors (stdlib + numpy only).

The per-page loops (page_ops, batching, prefix_index) are compiled by Cython from their own .py
files when the package is built; COMPILED says whether this process runs that build (for the server
start-up log and GET /v1/pool). Without it the same files run as plain Python: correct, but
10 to 200 times slower (per-byte loops that only the compiler makes fast).
"""

from service.core import batching, page_ops, prefix_index

COMPILED_MODULES: dict[str, bool] = {m.__name__: m.COMPILED for m in (page_ops, batching, prefix_index)}
COMPILED: bool = all(COMPILED_MODULES.values())
