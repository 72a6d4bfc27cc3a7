"""The HTTP API reference as Markdown, rendered from the app's own OpenAPI schema.

The schema is what FastAPI builds from the routes and the wire models, so this page cannot drift from
the server: each operation with its parameters, request body and answers, then each model's fields.
"""

from __future__ import annotations

import json
from typing import Any

Schema = dict[str, Any]
METHODS = ("get", "post", "put", "patch", "delete")


def model_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def anchor(name: str) -> str:
    return f"model-{name.lower()}"


def type_of(schema: Schema) -> str:
    """A short, linked type: `integer`, `array of integer`, [Tensor](#model-tensor) or null, ..."""
    if "$ref" in schema:
        name = model_name(schema["$ref"])
        return f"[{name}](#{anchor(name)})"
    if "anyOf" in schema:
        return " or ".join(type_of(option) for option in schema["anyOf"])
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(value)}`" for value in schema["enum"])
    kind = schema.get("type", "any")
    if kind == "array":
        return f"array of {type_of(schema.get('items', {}))}"
    if kind == "object" and "additionalProperties" in schema and isinstance(schema["additionalProperties"], dict):
        return f"object of {type_of(schema['additionalProperties'])}"
    return f"`{kind}`"


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def bounds(schema: Schema) -> str:
    """Limits a reader needs (min/max, lengths, pattern), from the schema or its first non-null option."""
    options = [schema, *[o for o in schema.get("anyOf", []) if o.get("type") != "null"]]
    found = []
    for option in options:
        for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum", "minLength", "maxLength"):
            if key in option:
                value = option[key]
                found.append(f"{key} {int(value) if float(value).is_integer() else value}")
        if "pattern" in option:
            found.append(f"pattern `{option['pattern']}`")
    return ", ".join(found)


def field_rows(model: Schema) -> list[str]:
    required = set(model.get("required", []))
    rows = ["| field | type | required | default | meaning |", "|---|---|---|---|---|"]
    for name, prop in model.get("properties", {}).items():
        default = f"`{json.dumps(prop['default'])}`" if "default" in prop else ""
        meaning = "; ".join(part for part in (prop.get("description", ""), bounds(prop)) if part)
        rows.append(
            f"| `{name}` | {type_of(prop)} | {'yes' if name in required else ''} | {default} | {cell(meaning)} |"
        )
    return rows


def operation_section(path: str, method: str, op: Schema) -> list[str]:
    lines = [f"### `{method.upper()} {path}`", ""]
    if op.get("description"):
        lines += [op["description"].strip(), ""]
    params = op.get("parameters", [])
    if params:
        lines += ["| parameter | in | type | required | meaning |", "|---|---|---|---|---|"]
        for p in params:
            meaning = "; ".join(part for part in (p.get("description", ""), bounds(p.get("schema", {}))) if part)
            lines.append(
                f"| `{p['name']}` | {p['in']} | {type_of(p.get('schema', {}))} | "
                f"{'yes' if p.get('required') else ''} | {cell(meaning)} |"
            )
        lines.append("")
    body = op.get("requestBody", {}).get("content", {})
    for media, content in body.items():
        lines += [f"Body (`{media}`): {type_of(content.get('schema', {}))}", ""]
    lines += ["| status | meaning | body |", "|---|---|---|"]
    for status, answer in op.get("responses", {}).items():
        content = answer.get("content", {})
        shown = ", ".join(f"{type_of(c.get('schema', {}))} (`{media}`)" for media, c in content.items())
        lines.append(f"| {status} | {cell(answer.get('description', ''))} | {shown} |")
    return [*lines, ""]


def render(schema: Schema) -> str:
    info = schema["info"]
    lines = [
        "# API reference",
        "",
        f"Generated from the OpenAPI schema of `kvpool serve` {info['version']} (default settings) when the site is "
        "built; the server serves the same schema at `/openapi.json` and an explorer at `/docs`. The schema "
        "is also here as [openapi.json](openapi.json). The [HTTP API guide](http-api.md) explains the routes; "
        "every error answer has the envelope [ErrorOut](#model-errorout).",
        "",
        "## Operations",
        "",
    ]
    for path, operations in schema["paths"].items():
        for method in METHODS:
            if method in operations:
                lines += operation_section(path, method, operations[method])
    lines += ["## Models", ""]
    for name, model in sorted(schema.get("components", {}).get("schemas", {}).items()):
        lines += [f"### {name} {{ #{anchor(name)} }}", ""]
        if model.get("description"):
            lines += [model["description"].strip(), ""]
        if "properties" in model:
            lines += field_rows(model)
        else:
            lines.append(f"Type: {type_of(model)}")
        lines.append("")
    return "\n".join(lines)
