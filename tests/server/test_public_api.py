"""FastAPI, Starlette and uvicorn through their public API only (docs/DESIGN.md).

Every module under service/, kernels/ and benchmarks/ is read as an AST and checked for: an import of a
private module or name (`from fastapi.routing import _X`, `import starlette._utils`), attribute access to
a private name through a framework import (`fastapi.routing._X`, `APIRoute._embed_body_fields`), a
`getattr`/`hasattr`/`setattr` of a private name on one, a private attribute of a framework object
(`request._body` where the parameter is annotated `request: Request`; `self._x` in a subclass of a
framework class when the subclass does not define `_x` itself), and a subclass of their routing or
protocol classes. Dunder names (`FastAPI.__init__`) are public Python protocol, not private API.
"""

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

FRAMEWORKS = ("fastapi", "starlette", "uvicorn")
# Classes whose subclasses re-implement framework internals: routes, routers, protocols.
CLOSED_MODULES = ("fastapi.routing", "starlette.routing", "uvicorn.protocols")
SCANNED = ("service", "kernels", "benchmarks")


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def is_framework(qualified: str) -> bool:
    return qualified.split(".", 1)[0] in FRAMEWORKS


def qualified_name(node: ast.expr, bound: dict[str, str]) -> str | None:
    """`a.b.c` with `a` bound to a framework import, spelled from the framework's root; else None."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        base = qualified_name(node.value, bound)
        return None if base is None else f"{base}.{node.attr}"
    return None


def violations(source: str) -> Iterator[str]:
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the framework module or object it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if is_framework(alias.name):
                    if any(is_private(part) for part in alias.name.split(".")):
                        yield f"line {node.lineno}: import {alias.name}"
                    local = alias.asname or alias.name.split(".", 1)[0]
                    bound[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom) and node.module and is_framework(node.module):
            if any(is_private(part) for part in node.module.split(".")):
                yield f"line {node.lineno}: from {node.module} import ..."
            for alias in node.names:
                if is_private(alias.name):
                    yield f"line {node.lineno}: from {node.module} import {alias.name}"
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            owner = qualified_name(node.value, bound)
            if owner is not None:
                yield f"line {node.lineno}: {owner}.{node.attr}"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2:
            if node.func.id in ("getattr", "hasattr", "setattr", "delattr"):
                owner, name = qualified_name(node.args[0], bound), node.args[1]
                if owner is not None and isinstance(name, ast.Constant) and isinstance(name.value, str):
                    if is_private(name.value):
                        yield f"line {node.lineno}: {node.func.id}({owner}, {name.value!r})"
        elif isinstance(node, ast.ClassDef):
            for base in node.bases:
                qualified = qualified_name(base, bound)
                if qualified is not None and qualified.startswith(CLOSED_MODULES):
                    yield f"line {node.lineno}: class {node.name}({qualified})"
            yield from inherited_private_uses(node, bound)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from private_uses_of_parameters(node, bound)


def framework_annotation(annotation: ast.expr | None, bound: dict[str, str]) -> str | None:
    """The framework class an annotation names (`Request`, `Request | None`, `"Request"`), else None."""
    if annotation is None:
        return None
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return framework_annotation(ast.parse(annotation.value, mode="eval").body, bound)
    if isinstance(annotation, ast.BinOp):  # X | None
        return framework_annotation(annotation.left, bound) or framework_annotation(annotation.right, bound)
    if isinstance(annotation, ast.Subscript):  # Optional[X], Annotated[X, ...]
        inner = annotation.slice
        first = inner.elts[0] if isinstance(inner, ast.Tuple) else inner
        return framework_annotation(first, bound)
    return qualified_name(annotation, bound)


def private_uses_of_parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef, bound: dict[str, str]) -> Iterator[str]:
    """`param._x` in `fn`, where `param` is annotated with a framework class."""
    args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
    typed = {a.arg: t for a in args if (t := framework_annotation(a.annotation, bound)) is not None}
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and is_private(node.attr) and isinstance(node.value, ast.Name):
            if node.value.id in typed:
                yield f"line {node.lineno}: {node.value.id}._{node.attr[1:]} ({typed[node.value.id]})"


def inherited_private_uses(cls: ast.ClassDef, bound: dict[str, str]) -> Iterator[str]:
    """`self._x` in a subclass of a framework class, `_x` being none of the subclass's own names."""
    bases = [q for base in cls.bases if (q := qualified_name(base, bound)) is not None]
    if not bases:
        return
    own = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(cls):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            own |= {t.attr for t in targets if isinstance(t, ast.Attribute)}
            own |= {t.id for t in targets if isinstance(t, ast.Name)}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and is_private(node.attr) and node.attr not in own:
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                yield f"line {node.lineno}: self.{node.attr} (inherited from {bases[0]})"


def modules() -> list[Path]:
    found = sorted(path for folder in SCANNED for path in (REPO / folder).rglob("*.py"))
    assert len(found) > 50 and REPO / "service" / "server" / "app.py" in found  # the walk reaches the tree
    return found


def test_no_module_uses_private_framework_api() -> None:
    found = {str(path.relative_to(REPO)): list(violations(path.read_text())) for path in modules()}
    assert {path: lines for path, lines in found.items() if lines} == {}


# What the deleted fast paths did, each of which the check must catch.
PRIVATE_USES = {
    "from starlette._utils import get_route_path": "from starlette._utils import ...",
    "import starlette._utils": "import starlette._utils",
    "from fastapi._compat import ModelField": "from fastapi._compat import ...",
    "from fastapi.routing import _IncludedRouter": "from fastapi.routing import _IncludedRouter",
    "import fastapi.routing\nx = fastapi.routing._FASTAPI_SCOPE_KEY": "fastapi.routing._FASTAPI_SCOPE_KEY",
    "import fastapi.routing as r\nx = r._effective_route_context_var": "fastapi.routing._effective_route_context_var",
    "import fastapi.routing\nx = getattr(fastapi.routing, '_IncludedRouter', None)": "getattr(fastapi.routing, ",
    "from fastapi.routing import APIRoute\ndef f(r: APIRoute):\n    return APIRoute._embed_body_fields": "APIRoute._e",
    "from starlette.requests import Request\ndef f(r: Request):\n    return hasattr(Request, '_body')": "hasattr(",
    "from fastapi.routing import APIRoute\nclass R(APIRoute): pass": "class R(fastapi.routing.APIRoute)",
    "from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol\nclass P(HttpToolsProtocol): pass": (
        "class P(uvicorn.protocols.http.httptools_impl.HttpToolsProtocol)"
    ),
    "import starlette.routing\nclass R(starlette.routing.Router): pass": "class R(starlette.routing.Router)",
    "from starlette.requests import Request\nasync def f(request: Request):\n    return request._body": (
        "request._body (starlette.requests.Request)"
    ),
    "from fastapi import Request\ndef f(r: 'Request | None'):\n    r._stream_consumed = True": "r._stream_consumed",
    "import uvicorn\nclass S(uvicorn.Server):\n    def f(self):\n        return self._servers": (
        "self._servers (inherited from uvicorn.Server)"
    ),
}
PUBLIC_USES = [
    "import inspect\nfrom fastapi import FastAPI\ninspect.signature(FastAPI.__init__)",
    "import uvicorn\nclass S(uvicorn.Server):\n    def handle_exit(self, sig, frame): pass",
    "from starlette.routing import Match\nx = Match.FULL",
    "from starlette.requests import Request\nasync def f(request: Request):\n    return await request.body()",
    "import uvicorn\nclass S(uvicorn.Server):\n    def __init__(self):\n        self._mine = 1\n    def f(self):\n"
    "        return self._mine",
    "import numpy as np\nx = np._private",  # not a framework
    "from fastapi import Request\nclass Body:\n    _cache = 1\n    def f(self):\n        return self._cache",
]


@pytest.mark.parametrize("source", list(PRIVATE_USES))
def test_the_check_finds_private_uses(source: str) -> None:
    found = list(violations(source))
    assert any(PRIVATE_USES[source] in line for line in found), found


@pytest.mark.parametrize("source", PUBLIC_USES)
def test_the_check_passes_public_uses(source: str) -> None:
    assert list(violations(source)) == []
