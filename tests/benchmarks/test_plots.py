"""benchmarks/plots.py and report.py: every figure of the benchmarks page redraws from the JSON beside it,
and a result names the command that made it. (The benchmarks' own --plot runs are in test_alloc.py,
test_http.py and test_tiers.py.)"""

import json
import re
from pathlib import Path

import pytest

from benchmarks.plots import DRAWERS, draw, main
from benchmarks.report import command_without_outputs, new_result
from tests.benchmarks.pictures import assert_png
from tests.conftest import REPO

FIGURES = REPO / "docs" / "figures"
PAGE = REPO / "docs" / "benchmarks.md"


def saved_results() -> list[Path]:
    return sorted(FIGURES.glob("*.json"))


def test_the_page_shows_every_figure_and_each_has_its_json() -> None:
    shown = re.findall(r"!\[[^\]]*\]\(figures/([\w.-]+\.png)\)", PAGE.read_text())
    pictures = sorted(p.name for p in FIGURES.glob("*.png"))
    assert sorted(shown) == pictures and len(pictures) >= 4
    assert [p.stem for p in saved_results()] == [Path(name).stem for name in pictures]
    kinds = {json.loads(p.read_text())["kind"] for p in saved_results()}
    assert kinds == {"alloc-peers", "http", "tiers", "vllm-connector"}


@pytest.mark.parametrize("result", saved_results(), ids=lambda p: p.stem)
def test_each_saved_result_redraws(result: Path, tmp_path: Path) -> None:
    data = json.loads(result.read_text())
    assert data["kind"] in DRAWERS
    assert {"command", "date", "machine", "source"} <= set(data)
    out = tmp_path / f"{result.stem}.png"
    assert main([str(result), str(out)]) == 0
    assert_png(out)


def test_a_result_of_an_unknown_kind_is_refused(tmp_path: Path) -> None:
    result = {**new_result("nothing-to-draw", ["kvpool", "bench", "x"]), "machine": {}}
    with pytest.raises(SystemExit, match="no drawing for results of kind 'nothing-to-draw'"):
        draw(result, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_the_command_is_kept_without_its_output_paths() -> None:
    argv = ["kvpool", "bench", "http", "--json", "/tmp/a b.json", "--clients", "1,4", "--plot=/tmp/p.png"]
    assert command_without_outputs(argv) == "kvpool bench http --clients 1,4"
    assert new_result("http", argv)["command"] == "kvpool bench http --clients 1,4"
