"""JSON Schemas of ckptconv's metadata files (draft 2020-12).

Every document is validated by a validator compiled from its schema (fastjsonschema: the schema
turned into Python code, ~40x faster than walking it, which matters for a store's metadata of
10^5 tensors); a document it rejects is validated again by ``jsonschema``, whose messages name
every violation. The schemas use only keywords both read alike (no ``$ref`` beside other
keywords, no ``format`` assertions): ``tests/test_schemas.py`` checks that, and that the two agree
on valid and damaged documents.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any, Callable


@cache
def load_schema(name: str) -> dict[str, Any]:
    """The parsed schema ``schemas/<name>.schema.json``."""
    return json.loads(resources.files(__name__).joinpath(f"{name}.schema.json").read_text())


@cache
def _validator(name: str) -> Any:
    import jsonschema

    return jsonschema.Draft202012Validator(load_schema(name))


@cache
def _compiled(name: str) -> Callable[[Any], Any] | None:
    """The compiled validator of schema ``name`` (None without fastjsonschema: jsonschema alone)."""
    try:
        import fastjsonschema
    except ImportError:  # pragma: no cover - a declared dependency; keep working without it
        return None
    return fastjsonschema.compile(load_schema(name), use_formats=False)


def is_valid(name: str, document: Any) -> bool:
    """Whether ``document`` satisfies schema ``name``: the compiled validator's verdict (jsonschema
    runs only to word a rejection)."""
    return not validation_errors(name, document)


def validation_errors(name: str, document: Any) -> list[str]:
    """Every violation of schema ``name`` by ``document``, as 'path: message' lines (none: valid).

    A document the compiled validator accepts is valid; one it rejects is described by
    ``jsonschema``."""
    fast = _compiled(name)
    if fast is not None:
        import fastjsonschema

        try:
            fast(document)
            return []
        except fastjsonschema.JsonSchemaException as e:
            first = f"{e.name or '<root>'}: {e.message}"
    else:
        first = ""
    validator = _validator(name)
    errors = [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in sorted(validator.iter_errors(document), key=lambda e: list(map(str, e.path)))
    ]
    return errors or ([first] if first else [])
