"""The server's size limits in /openapi.json, where clients and fuzzers read the shape of a request.
They depend on the model and the flags, so they are written into the generated schema when it is first
served; the routes enforce them either way (a 400 naming the field)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI

# model name → field → JSON Schema bounds (`maxLength` for a string, `maxItems` for an array)
Limits = Mapping[str, Mapping[str, dict[str, int]]]


def publish_limits(app: FastAPI, limits: Callable[[], Limits]) -> None:
    """`limits()` is called once, when /openapi.json is first generated."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            components = generate()["components"]["schemas"]
            for model, fields in limits().items():
                for name, bounds in fields.items():
                    _bound(components[model]["properties"][name], bounds)
        return app.openapi_schema  # type: ignore[return-value]  # set by generate()

    app.openapi = openapi  # type: ignore[method-assign]


def _bound(prop: dict[str, Any], bounds: dict[str, int]) -> None:
    """On the property, or on the member of its `anyOf` that the bounds are for (`x: str | None`)."""
    kind = "string" if "maxLength" in bounds else "array"
    members = [m for m in prop.get("anyOf", [prop]) if m.get("type") == kind]
    if not members:
        raise ValueError(f"no {kind} in {prop} to bound")
    for member in members:
        member.update(bounds)
