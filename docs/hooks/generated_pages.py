"""MkDocs hooks: pages made at build time from the repository's one source of each.

- `index.md` is README.md, its `docs/...` links pointed at the pages beside it (README stays the front
  page on GitHub and on the site alike);
- `reference.md` and `openapi.json`: the API reference, rendered from the OpenAPI schema of the app built
  with default settings (no server started, no network).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[2]
HOOKS = Path(__file__).resolve().parent
# mkdocs loads this file by path and puts back sys.path afterwards: import the repository's packages and
# the renderer beside this file now.
sys.path[:0] = [str(REPO), str(HOOKS)]
from openapi_markdown import render  # noqa: E402

from service.config import Settings  # noqa: E402
from service.server.app import create_app  # noqa: E402


def readme_as_index() -> str:
    text = (REPO / "README.md").read_text()
    return re.sub(r"\]\(docs/", "](", text)


def openapi_schema() -> dict[str, Any]:
    # The schema depends on the routes and the wire models, not on the pool: the smallest pool will do.
    app = create_app(Settings(num_pages=1))
    try:
        return app.openapi()
    finally:
        app.state.pool.close()


def on_files(files: Files, config: Any) -> Files:
    schema = openapi_schema()
    files.append(File.generated(config, "index.md", content=readme_as_index()))
    files.append(File.generated(config, "reference.md", content=render(schema)))
    files.append(File.generated(config, "openapi.json", content=json.dumps(schema, indent=1)))
    return files
