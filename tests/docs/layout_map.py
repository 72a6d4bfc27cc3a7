"""The layout map of docs/DESIGN.md (its first code block under "## Layout"), read as a tree of entries.

An entry is a line that starts with names, comma-separated (`service/`, `  core/`, `    allocator.py`,
`  config.py, tenancy.py, cli.py`), indented two spaces per level under the folder above it; what follows
the names (after two spaces or more) and the lines indented deeper than an entry can be are its
description. A description may name more modules (`models.py (pydantic)`) or folders (`routes/`) of the
entry's folder, or paths from the repository's root (`deploy/requirements.txt`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

NAME = r"[\w.-]+/?"
ENTRY = re.compile(rf"^(?P<indent> *)(?P<names>{NAME}(?:, {NAME})*)(?: {{2,}}(?P<text>.*)|$)")
# In descriptions: a module or header file, or a folder or path with a slash (not a URL, not "a/b" prose).
MENTION = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.(?:py|pyx|pxd|c|h)|(?:[\w-]+/)+(?:[\w-]+\.\w+)?)(?![\w/])")


@dataclass
class Entry:
    path: str  # from the repository's root; folders end with "/"
    depth: int
    mentions: list[str] = field(default_factory=list)  # names in its description


def layout_block(design: str) -> str:
    section = design.split("\n## Layout\n", 1)[1]
    return section.split("```", 2)[1].split("\n", 1)[1]


def parse(block: str) -> list[Entry]:
    entries: list[Entry] = []
    folders: list[str] = []  # the folder open at each depth: an entry may sit at most one level below the last
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        match = ENTRY.match(line)
        if match and indent % 2 == 0 and indent // 2 <= len(folders):
            depth = indent // 2
            del folders[depth:]
            names = match["names"].split(", ")
            entries += [Entry("".join(folders) + name, depth) for name in names]
            if len(names) == 1 and names[0].endswith("/"):
                folders.append(names[0])
            text = match["text"] or ""
        else:
            text = line
        if entries:
            entries[-1].mentions += MENTION.findall(text)
    return entries


def problems(repo: Path, block: str) -> list[str]:
    """What the map names that is not in the tree, and the packages of service/ it leaves out."""
    entries = parse(block)
    found: list[str] = []
    named = {entry.path for entry in entries}
    for entry in entries:
        if not (repo / entry.path).exists():
            found.append(f"the map names {entry.path}, which does not exist")
        folder = (
            entry.path if entry.path.endswith("/") else entry.path.rsplit("/", 1)[0] + "/" if "/" in entry.path else ""
        )
        for mention in entry.mentions:
            candidates = [repo / folder / mention, repo / mention]
            if not any(c.exists() for c in candidates):
                where = f"neither in {folder or './'} nor at the root"
                found.append(f"{entry.path}: its description names {mention}, which is {where}")
            named.add(folder + mention)
    packages = sorted(
        {
            p.parent.relative_to(repo).as_posix() + "/"
            for p in (repo / "service").rglob("*.py")
            if "__pycache__" not in p.parts
        }
    )
    for package in packages:
        if package not in named:
            found.append(f"the package {package} is not named in the map")
    return found
