"""Open any supported checkpoint by sniffing its directory: DCP (``.metadata`` + ``.distcp``, or
the per-rank safetensors of DCP's ``HuggingFaceStorageWriter``), universal store, HF safetensors,
DeepSpeed (universal checkpoints, and the folders ``save_checkpoint`` writes)."""

from __future__ import annotations

import gc
import os

from converter.run import timings
from formats.base import CheckpointReader
from formats.errors import CheckpointNotFoundError, IncompleteCheckpointError, InvalidCheckpointError


def detect_format(path: str | os.PathLike) -> str:
    """"dcp", "dcp-safetensors" (DCP's per-rank safetensors storage), "universal", "hf",
    "deepspeed" (a local DeepSpeed universal checkpoint), "deepspeed-zero" (a local DeepSpeed
    ``save_checkpoint`` folder) or "megatron-legacy" (Megatron-LM's ``mp_rank_*`` folders) for a
    local directory or a URL; a clear error for anything else."""
    from formats.storage import open_storage

    st = open_storage(path)
    p = st.root
    if st.is_local:
        if not p.exists():
            raise CheckpointNotFoundError(f"{p}: no such file or directory; check the path")
        if not p.is_dir():
            raise InvalidCheckpointError(f"{p}: is a file; pass the checkpoint directory (the one holding .metadata)")
        names = os.listdir(p)
        from converter.run.destination import unfinished_message

        unfinished = unfinished_message(p)  # a ckptconv output not finished (yet): say how to finish it
        if unfinished is not None:
            raise IncompleteCheckpointError(unfinished)
    else:
        names = st.list()
        if not names:
            if st.exists():
                raise InvalidCheckpointError(f"{p}: is an object; pass the checkpoint's prefix (the one holding .metadata)")
            raise CheckpointNotFoundError(f"{p}: nothing under this URL; check the bucket and prefix")
    return _format_of(st, names)


def _format_of(st, names: list[str]) -> str:  # noqa: ANN001 - a formats.storage.Storage
    from formats.dcp.metadata import METADATA_NAME, rank_metadata_files
    from formats.dcp_safetensors import is_per_rank_listing, missing_sharded_hint
    from formats.universal import is_universal_store

    p = st.root
    if is_universal_store(st):
        return "universal"
    if st.is_local and ("latest" in names or any(n.endswith("_model_states.pt") for n in names)) \
            and "zero" not in names:
        from formats.deepspeed_zero import is_deepspeed_zero

        if is_deepspeed_zero(p):  # before HF: a Trainer's checkpoint-N/ holds both; this has the fp32 masters
            return "deepspeed-zero"
    if METADATA_NAME in names or rank_metadata_files(names):
        return "dcp"
    if "model.safetensors.index.json" not in names and is_per_rank_listing(names):
        return "dcp-safetensors"
    if any(n.endswith(".safetensors") for n in names) or "model.safetensors.index.json" in names:
        return "hf"
    hint = missing_sharded_hint(p, names) if st.is_local else None
    if hint is not None:
        raise InvalidCheckpointError(hint)
    if st.is_local and ("zero" in names or "latest_universal" in names):
        from formats.deepspeed import is_deepspeed_universal

        if is_deepspeed_universal(p):
            return "deepspeed"
    from formats.megatron.folders import is_legacy_checkpoint

    if is_legacy_checkpoint(names):
        return "megatron-legacy"
    if not names:
        raise InvalidCheckpointError(f"{p}: directory is empty; pass a DCP checkpoint directory (with .metadata)")
    if any(n.endswith(".distcp") for n in names):
        raise IncompleteCheckpointError(
            f"{p}: has .distcp files but no .metadata: the save did not finish (DCP writes .metadata last); "
            "re-run the save or use another checkpoint"
        )
    raise InvalidCheckpointError(
        f"{p}: not a checkpoint ckptconv knows (no .metadata, ckptconv.json or *.safetensors); "
        "pass a DCP directory, a universal store or a Hugging Face directory"
    )


def open_checkpoint(path: str | os.PathLike, trust_pickle: bool = False, verify: bool = False) -> CheckpointReader:
    """A reader for the checkpoint at ``path``, whatever its format.

    ``verify``: check each chunk's stored integrity data (DCP zip CRC-32, universal xxh3_64) as it
    is read, once per chunk; every conversion passes ``RunOptions.verify_source`` (on by default).

    The index (millions of small objects for a large checkpoint) lives as long as the command:
    it is moved out of the cyclic GC's reach, so the collections that planning's allocations
    trigger do not walk it again and again (seconds at 10^6 chunks).
    """
    reader = _open(path, trust_pickle, verify)
    gc.freeze()
    timings.mark("source")
    return reader


def _open(path: str | os.PathLike, trust_pickle: bool, verify: bool) -> CheckpointReader:
    fmt = detect_format(path)
    if fmt == "universal":
        from formats.universal import UniversalReader

        return UniversalReader(path, verify=verify)
    if fmt == "dcp":
        from formats.dcp import DCPReader

        return DCPReader(path, trust_pickle=trust_pickle, verify=verify)
    if fmt == "dcp-safetensors":
        from formats.dcp_safetensors import DCPSafetensorsReader

        return DCPSafetensorsReader(path, verify=verify)
    if fmt == "deepspeed-zero":
        from formats.deepspeed_zero import DeepSpeedZeroReader

        return DeepSpeedZeroReader(path, verify=verify)
    if fmt == "deepspeed":
        from formats.deepspeed import DeepSpeedReader

        return DeepSpeedReader(path, verify=verify)
    if fmt == "megatron-legacy":
        from formats.megatron.legacy import LegacyReader

        return LegacyReader(path, trust_pickle=trust_pickle, verify=verify)
    from formats.hf import HFReader  # type: ignore[import-not-found]

    return HFReader(path, verify=verify)


def framework_files(reader: CheckpointReader, src: str | os.PathLike, trust_pickle: bool = False) -> dict[str, bytes]:
    """The framework files a conversion of ``reader``'s checkpoint carries beside DCP's own
    (``formats.dcp.framework_files``): read from a DCP or universal source, made by a reader that
    presents another format as torch_dist (Megatron legacy: ``metadata.json``)."""
    made = getattr(reader, "framework_files", None)
    if callable(made):
        return made()
    if reader.index().format in ("dcp", "universal"):
        from formats.dcp.framework_files import read_framework_files

        return read_framework_files(src, trust_pickle)
    return {}
