"""The routes of one module, added flat to the app, and the OpenAPI text of bodies endpoints read themselves.

Why not `APIRouter` + `include_router`: newer FastAPI keeps an included router whole and walks it on
every request; `app.add_api_route` puts each route straight into the app's own table. `RouteTable`
keeps the decorator style of a router and calls `add_api_route` once per route (FastAPI's public API).

Endpoints that parse their body with `service.server.bodies` declare no body parameter, so FastAPI
does not document one: `body=` gives the operation its `requestBody` through `openapi_extra`, a
reference to the model's schema, and `document_request_bodies` adds those schemas to the document's
components, so /openapi.json reads exactly as if FastAPI had parsed the bodies itself.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi.encoders import jsonable_encoder
from fastapi.openapi.models import OpenAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

Endpoint = TypeVar("Endpoint", bound=Callable[..., Any])
REF_TEMPLATE = "#/components/schemas/{model}"


@dataclass
class RouteTable:
    tags: list[str]
    routes: list[tuple[str, str, Callable[..., Any], dict[str, Any]]] = field(default_factory=list)
    body_models: list[type[BaseModel]] = field(default_factory=list)

    def route(
        self, method: str, path: str, body: type[BaseModel] | None = None, body_required: bool = True, **options: Any
    ) -> Callable[[Endpoint], Endpoint]:
        """Record an endpoint; `options` are add_api_route's (status_code, response_model, responses...)."""
        if body is not None:
            options["openapi_extra"] = request_body(body, body_required)
            self.body_models.append(body)

        def record(endpoint: Endpoint) -> Endpoint:
            self.routes.append((method, path, endpoint, options))
            return endpoint

        return record

    def get(self, path: str, **options: Any) -> Callable[[Endpoint], Endpoint]:
        return self.route("GET", path, **options)

    def post(self, path: str, **options: Any) -> Callable[[Endpoint], Endpoint]:
        return self.route("POST", path, **options)

    def delete(self, path: str, **options: Any) -> Callable[[Endpoint], Endpoint]:
        return self.route("DELETE", path, **options)

    def add_to(self, app: FastAPI) -> None:
        for method, path, endpoint, options in self.routes:
            app.add_api_route(path, endpoint, methods=[method], tags=list(self.tags), **options)


def request_body(model: type[BaseModel], required: bool) -> dict[str, Any]:
    """The operation's `requestBody`, as FastAPI writes it for a body parameter of type `model`
    (an optional one: `model | None`, titled "Body")."""
    ref = {"$ref": REF_TEMPLATE.format(model=model.__name__)}
    if required:
        return {"requestBody": {"content": {"application/json": {"schema": ref}}, "required": True}}
    optional = {"anyOf": [ref, {"type": "null"}], "title": "Body"}
    return {"requestBody": {"content": {"application/json": {"schema": optional}}}}


def document_request_bodies(app: FastAPI, models: Iterable[type[BaseModel]]) -> None:
    """Add the schemas of `models` (and of the models they nest) to the app's OpenAPI components.

    FastAPI documents the way to change the generated document: replace `app.openapi` with a function
    that builds it once (FastAPI caches it in `app.openapi_schema`) and edits it.
    """
    generate = app.openapi
    models = list(dict.fromkeys(models))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = generate()
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        _, definitions = models_json_schema([(m, "validation") for m in models], ref_template=REF_TEMPLATE)
        for name, schema in definitions.get("$defs", {}).items():
            # A model documented already (e.g. Tensor, also in responses) must be the same schema.
            if schemas.setdefault(name, schema) != schema:
                raise RuntimeError(f"two different OpenAPI schemas are named {name}")
        document["components"]["schemas"] = dict(sorted(schemas.items()))
        # Through FastAPI's OpenAPI model, as get_openapi writes the rest (e.g. no null defaults).
        app.openapi_schema = jsonable_encoder(OpenAPI(**document), by_alias=True, exclude_none=True)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
