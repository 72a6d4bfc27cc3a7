"""The compiled modules of the core, each with a Python twin that runs when it is not built (a source
tree used without `pip install`): service/core/_prefix.c (the prefix cache's per-page loops; twin:
prefix_index.py), service/core/_batch.c (a step's per-sequence loop; twin: batching.py) and
service/core/_pages.c (allocation's per-page loops; twin: page_ops.py); and kernels/_cpu_decode.c, the
CPU backend's decode attention (without it, the torch reference runs: kernels/cpu_decode.py).

Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("service.core._prefix", sources=["service/core/_prefix.c"]),
        Extension("service.core._batch", sources=["service/core/_batch.c"]),
        Extension("service.core._pages", sources=["service/core/_pages.c"]),
        Extension("kernels._cpu_decode", sources=["kernels/_cpu_decode.c"]),
    ]
)
