"""docs/DESIGN.md's layout map against the tree: everything it names exists, and every package of
service/ is in it. The map is read by tests/docs/layout_map.py; the checker is tried on maps made wrong."""

from pathlib import Path

from tests.conftest import REPO
from tests.docs.layout_map import layout_block, parse, problems

DESIGN = REPO / "docs" / "DESIGN.md"


def test_the_design_layout_map_matches_the_tree() -> None:
    assert problems(REPO, layout_block(DESIGN.read_text())) == []


def test_the_map_is_read_as_a_tree_of_folders_files_and_mentions() -> None:
    block = """\
pyproject.toml        tool settings
service/
  core/               numpy + stdlib:
    allocator.py        free stack
    lru.py, plan.py
                        compiled; plan.py places pages, sequences.py applies them
  server/             app (app.py), routes/ (thin)
  cli.py              `kvpool serve`; deploy/requirements.txt pins
kernels/              one kernel per file: @triton.jit + a torch reference
"""
    entries = {entry.path: entry for entry in parse(block)}
    assert list(entries) == [
        "pyproject.toml",
        "service/",
        "service/core/",
        "service/core/allocator.py",
        "service/core/lru.py",
        "service/core/plan.py",
        "service/server/",
        "service/cli.py",
        "kernels/",
    ]
    assert [entries[p].depth for p in entries] == [0, 0, 1, 2, 2, 2, 1, 1, 0]
    assert entries["service/core/plan.py"].mentions == ["plan.py", "sequences.py"]
    assert entries["service/server/"].mentions == ["app.py", "routes/"]
    assert entries["service/cli.py"].mentions == ["deploy/requirements.txt"]
    assert entries["kernels/"].mentions == []


def _tree(root: Path, files: list[str]) -> None:
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")


def test_the_check_names_what_is_missing_and_what_is_left_out(tmp_path: Path) -> None:
    _tree(tmp_path, ["service/cli.py", "service/core/allocator.py", "service/core/lru.py", "service/server/app.py"])
    _tree(tmp_path, ["service/server/routes/pool.py", "service/tiers/local.py"])
    block = """\
service/
  core/               allocator.py, sequences.py
    lru.py, gone.py
  server/             app.py
  cli.py
"""
    assert problems(tmp_path, block) == [
        "service/core/: its description names sequences.py, which is neither in service/core/ nor at the root",
        "the map names service/core/gone.py, which does not exist",
        "the package service/server/routes/ is not named in the map",
        "the package service/tiers/ is not named in the map",
    ]
    fixed = block.replace(", sequences.py", "").replace(", gone.py", "").replace("app.py", "app.py, routes/")
    assert problems(tmp_path, fixed + "  tiers/              local.py\n") == []
