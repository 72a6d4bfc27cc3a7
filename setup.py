"""The compiled parts: the core's per-page loops, compiled by Cython from their one Python source
(service/core/page_ops.py, batching.py, lru.py, probe_hash.py, prefix_index.py, token_ids.py:
pure-Python mode, so each file also runs as plain Python), kernels/_cpu_decode.c, the CPU
backend's decode attention (without it, the torch reference runs: kernels/cpu_decode.py), and
service/integrations/_vllm_copy.c, the vLLM connector's K/V copies (without it, torch ops do them).
A failed compile fails the install.

Everything else is in pyproject.toml.
"""

from Cython.Build import cythonize
from setuptools import Extension, setup

CORE = [
    "service/core/page_ops.py",
    "service/core/batching.py",
    "service/core/lru.py",  # (these two before prefix_index.py, which calls them from C: their .pxd)
    "service/core/probe_hash.py",
    "service/core/token_ids.py",
    # SHA-256 from OpenSSL's libcrypto (the library hashlib wraps): building needs its headers
    # (libssl-dev); its SHA256_* calls are deprecated in OpenSSL 3 but kept, and are the fastest.
    Extension(
        "service.core.prefix_index",
        ["service/core/prefix_index.py"],
        libraries=["crypto"],
        define_macros=[("OPENSSL_SUPPRESS_DEPRECATED", None)],
    ),
]

setup(
    ext_modules=[
        # The generated C goes to build/, away from the sources and out of the wheel.
        *cythonize(CORE, build_dir="build/cython", language_level=3, compiler_directives={"embedsignature": True}),
        Extension("kernels._cpu_decode", sources=["kernels/_cpu_decode.c"]),
        # The vLLM connector's K/V copies (without it, torch ops do them: service/integrations/vllm_copy.py).
        Extension(
            "service.integrations._vllm_copy",
            sources=["service/integrations/_vllm_copy.c"],
            depends=["service/integrations/_vllm_copy_wide.h"],
        ),
    ]
)
