"""formats/dcp/metadata_pickle.py: the ``.metadata`` pickle by the C pickler (the private homes of
the stand-ins, renamed to torch's module names in place) is byte for byte the pure-Python
pickler's, which ``test_dcp_torch_free`` compares with ``dcp.save``'s; where a private name also
shows up in the data, the pure-Python pickler writes it."""

from __future__ import annotations

import pickle
import sys

import pytest

from formats.dcp import metadata_pickle as mp
from formats.dcp.torch_globals import DTYPE_NAMES, canonical_dtype_name


def _metadata(keys: list[str], dtypes: list[str], ranks: int = 3, objects: tuple[str, ...] = ("step",)) -> object:
    sd, storage = {}, {}
    for i, key in enumerate(keys):
        rows = 4 * ranks
        sd[key] = mp.tensor_storage_metadata(dtypes[i % len(dtypes)], (rows, 5),
                                             [((4 * r, 0), (4, 5)) for r in range(ranks)])
        for r in range(ranks):
            storage[mp.MetadataIndex(key, (4 * r, 0), r)] = mp.storage_info(f"__{r}_0.distcp", 1000 * i, 900)
    for key in objects:
        sd[key] = mp.bytes_storage_metadata()
        storage[mp.MetadataIndex(key)] = mp.storage_info("__0_0.distcp", 7, 11)
    planner = {k: tuple(k.split(".")) for k in sd}
    return mp.metadata(sd, planner, storage, "/ckpt/run 1", "save-id", "1.0.0", True)


DTYPES = sorted({canonical_dtype_name(n) for n in DTYPE_NAMES})


@pytest.mark.parametrize("keys", [
    [f"model.layers.{i}.w" for i in range(400)],  # memo indices past 255, frames past 64 KiB
    ["ü", "键.权重", "torch", "torch.distributed.checkpoint.metadata", "a\nb", ""],
    [],
])
def test_the_c_pickler_writes_the_pure_python_picklers_bytes(keys):
    md = _metadata(keys, DTYPES)
    fast = mp._fast_dumps(md)
    assert fast is not None  # the fast path is the one taken
    assert fast == mp.slow_dumps(md) == mp.dumps(md)


def test_objects_only_and_no_storage_meta():
    md = mp.metadata({"a": mp.bytes_storage_metadata()}, {"a": ("a",)}, {mp.MetadataIndex("a"): mp.storage_info("__0_0.distcp", 0, 3)},
                     "/c", "id", None, False)
    assert mp._fast_dumps(md) == mp.slow_dumps(md)


def test_private_modules_are_as_long_as_torchs_and_importable():
    assert set(mp._PRIVATE.private) >= {"torch", "torch.serialization", "torch.distributed.checkpoint.metadata",
                                        "torch.distributed.checkpoint.filesystem"}
    for real, private in mp._PRIVATE.private.items():
        assert len(private) == len(real) and private != real and sys.modules[private].__name__ == private


@pytest.mark.parametrize("real", ["torch", "torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"])
def test_a_private_name_in_the_data_falls_back_to_the_pure_python_pickler(real):
    """A key holding the very bytes a private module name is written as (UTF-8 of U+014C ends in
    0x8c, SHORT_BINUNICODE's opcode): renaming could touch the data, so it is not done."""
    private = mp._PRIVATE.private[real]
    key = "\u014c" + chr(len(private)) + private
    md = _metadata(["w", key], ["float32"])
    assert mp._fast_dumps(md) is None
    assert mp.dumps(md) == mp.slow_dumps(md)
    assert key.encode() in mp.dumps(md)  # the data is as it was


def test_unpickled_with_the_stand_ins_names():
    """The pickle names torch's modules only (no private name left)."""
    data = mp.dumps(_metadata(["w"], ["bfloat16"]))
    for private in mp._PRIVATE.private.values():
        assert private.encode() not in data
    names = {(a, b) for a, b in _globals(data)}
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in names and ("torch", "bfloat16") in names
    assert ("torch", "Size") in names and ("torch.distributed.checkpoint.filesystem", "_StorageInfo") in names


def _globals(data: bytes) -> list[tuple[str, str]]:
    import pickletools

    found, stack = [], []
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE"):
            stack.append(arg)
        elif op.name == "STACK_GLOBAL":
            found.append((stack[-2], stack[-1]))
        elif op.name in ("BINGET", "LONG_BINGET"):
            stack.append(None)
    return [(a, b) for a, b in found if a is not None]
