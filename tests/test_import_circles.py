"""No import circles: between the modules of service/ and kernels/ (imports at module level and under
`if TYPE_CHECKING:`, as a type is a dependency), and between their parts (service's subpackages and
top-level modules, kernels), where imports inside functions count too (a lazy import is still a
dependency: config.py once imported the tiers inside a validator, and the tiers imported the settings)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("service", "kernels")


def module_files() -> dict[str, Path]:
    mods = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def imports(name: str, path: Path, mods: dict[str, Path], nested: bool) -> set[str]:
    """The modules of ours `name` imports: at module level (and in `if`/`try` blocks there), or anywhere."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes = (
        ast.walk(tree)
        if nested
        else (n for top in tree.body for n in ([top] if not isinstance(top, (ast.If, ast.Try)) else ast.walk(top)))
    )
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in out if m in mods and m != name}


def part_of(module: str) -> str:
    """service.tiers.cache -> service.tiers; service.config -> service.config; kernels.decode -> kernels."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "service" else parts[0]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_finder_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_circle_between_modules() -> None:
    mods = module_files()
    assert len(mods) > 50, "the tree was not found"
    graph = {name: imports(name, path, mods, nested=False) for name, path in mods.items()}
    assert circles(graph) == []


@pytest.mark.parametrize("nested", [False, True], ids=["module level", "lazy imports too"])
def test_no_circle_between_parts(nested: bool) -> None:
    mods = module_files()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        graph.setdefault(part_of(name), set()).update(
            part_of(m) for m in imports(name, path, mods, nested) if part_of(m) != part_of(name)
        )
    assert "service.tiers" in graph and "service.config" in graph
    assert circles(graph) == []
