"""JSON Schemas of ckptconv's metadata files (draft 2020-12)."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any


@cache
def load_schema(name: str) -> dict[str, Any]:
    """The parsed schema ``schemas/<name>.schema.json``."""
    return json.loads(resources.files(__name__).joinpath(f"{name}.schema.json").read_text())


@cache
def _validator(name: str) -> Any:
    import jsonschema

    return jsonschema.Draft202012Validator(load_schema(name))


def validation_errors(name: str, document: Any) -> list[str]:
    """Every violation of schema ``name`` by ``document``, as 'path: message' lines."""
    validator = _validator(name)
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in sorted(validator.iter_errors(document), key=lambda e: list(map(str, e.path)))
    ]
