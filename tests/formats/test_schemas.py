"""The compiled schema validators (fastjsonschema) accept exactly what jsonschema accepts.

``schemas.validation_errors`` trusts the compiled validator when it accepts a document (the
store's metadata of every conversion goes through it, ~40x faster than jsonschema), so the two
must agree: on real documents, and on every single-point damage of them (a key removed, a value
of another type, an unknown key added).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

import schemas
from converter import api

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "converter" / "demo_data"
ALL = sorted(p.name.removesuffix(".schema.json") for p in (ROOT / "schemas").glob("*.schema.json"))
#: Values every damaged field is replaced with, in turn.
ODD_VALUES = (None, "x", "", -1, 0, 1.5, True, [], [1], {}, {"zz": 1})


def _jsonschema_valid(name: str, doc: object) -> bool:
    return not list(schemas._validator(name).iter_errors(doc))


def _walk_schema(node: object, path: str):
    if isinstance(node, dict):
        yield path, node
        for k, v in node.items():
            yield from _walk_schema(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk_schema(v, f"{path}/{i}")


@pytest.mark.parametrize("name", ALL)
def test_every_schema_uses_only_keywords_both_validators_read_alike(name):
    """A ``$ref`` beside other assertions means more in draft 2020-12 than in draft 7 (which the
    compiled validator follows), and ``format`` asserts in one and annotates in the other."""
    schema = schemas.load_schema(name)
    for path, node in _walk_schema(schema, ""):
        if "$ref" in node:
            assert set(node) - {"$ref", "description", "title", "$comment"} == set(), f"{name}{path}: $ref with siblings"
        if isinstance(node.get("format"), str) and not path.endswith("/properties"):
            pytest.fail(f"{name}{path}: a format keyword")
    assert schemas._compiled(name) is not None


def _damaged(doc: object, limit: int = 300):
    """Copies of ``doc`` with one point damaged: a key removed, a value replaced, a key added."""
    points: list[tuple] = []

    def visit(node: object, path: tuple) -> None:
        if isinstance(node, dict):
            points.append(("add", path))
            for k, v in node.items():
                points.append(("del", path + (k,)))
                points.append(("set", path + (k,)))
                visit(v, path + (k,))
        elif isinstance(node, list):
            for i, v in enumerate(node[:3]):
                points.append(("set", path + (i,)))
                visit(v, path + (i,))

    visit(doc, ())
    step = max(1, len(points) // limit)
    for kind, path in points[::step]:
        values = ODD_VALUES if kind == "set" else (None,)
        for value in values:
            out = copy.deepcopy(doc)
            parent = out
            for p in path[:-1] if kind != "add" else path:
                parent = parent[p]
            if kind == "add":
                parent["zz_unknown"] = 1
            elif kind == "del":
                del parent[path[-1]]
            else:
                parent[path[-1]] = value
            yield f"{kind} {'/'.join(map(str, path))} {value!r}", out


@pytest.fixture(scope="module")
def store_metadata(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("schemas") / "uni"
    api.to_universal(DEMO, out, options=api.RunOptions(progress=False))
    doc = json.loads((out / "ckptconv.json").read_text())
    for part in ("tensors", "objects", "atoms"):  # a few of each: every kind of field, damaged faster
        doc[part] = dict(list(doc[part].items())[:4])
    return doc


def test_a_real_store_metadata_is_valid_for_both(store_metadata):
    assert schemas.validation_errors("universal", store_metadata) == []
    assert _jsonschema_valid("universal", store_metadata)


def test_both_validators_agree_on_every_single_point_damage(store_metadata):
    checked = disagree = 0
    wrong = []
    for what, doc in _damaged(store_metadata):
        fast = schemas.is_valid("universal", doc)
        slow = _jsonschema_valid("universal", doc)
        checked += 1
        if fast != slow:
            disagree += 1
            wrong.append(f"{what}: compiled {fast}, jsonschema {slow}")
        if not slow:  # a rejected document is described by jsonschema's first message
            assert schemas.validation_errors("universal", doc), what
    assert checked > 300
    assert not wrong, f"{disagree} of {checked} damaged documents judged differently:\n" + "\n".join(wrong[:20])
