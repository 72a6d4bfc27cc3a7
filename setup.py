"""The one compiled module: service/core/_prefix.c (prefix-cache hashing loops; see that file).

Everything else is in pyproject.toml. service/core/prefix_index.py falls back to pure Python when the
module is not built (a source tree used without `pip install`), at a fifth of the speed on misses.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("service.core._prefix", sources=["service/core/_prefix.c"])])
