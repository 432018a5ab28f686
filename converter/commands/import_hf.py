"""import-hf: a Hugging Face safetensors directory -> a universal store (the inverse key map),
ready for ``from-universal``.

The plan (:mod:`converter.plan.hf_import`) gives every universal key its HF source tensor (and row
permutation); the source is read through a :class:`~converter.run.mapped_reader.MappedReader`
whose index names the universal keys, and the store is laid out and written as to-universal does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from converter.config import RunOptions
from converter.plan.atoms import group_atoms
from converter.plan.copy_tasks import describe, plan_universal, store_tasks, universal_chunk_bytes
from converter.plan.hf_config import load_config_arg, source_config
from converter.plan.adapter_maps import AdapterMap
from converter.plan.hf_import import adapter_notes, plan_import, tied_notes
from converter.plan.key_maps import KeyMap, get_key_map
from converter.run.destination import option_value
from converter.run.mapped_reader import MappedReader
from converter.run.quant_reader import DequantizedReader
from converter.run.pipeline import Conversion, ConversionResult, PlannedOutput, conversion_command, run_conversion
from converter.run.sinks import universal_output
from converter.run.sources import detect_format, open_checkpoint
from formats.dtypes import cast_dtype
from formats.errors import ConfigError
from formats.quant import block_size_of
from formats.storage import source_label
from formats.universal_meta import SourceInfo


def _import_config(src: str | os.PathLike, kmap: KeyMap,
                   config: str | os.PathLike | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The config: ``config`` when given, else ``src/config.json`` (head counts,
    tie_word_embeddings); an unreadable one of the source's own counts only when the map needs it."""
    if config is None and (src_config := source_config(src)) is not None:
        try:
            return load_config_arg(src_config)[0]
        except ConfigError:
            if kmap.transforms:  # the map needs it: say what is wrong with it
                raise
            return None  # only read for tie_word_embeddings: an unreadable one changes nothing
    return load_config_arg(config)[0]


def mx_layout(kmap: KeyMap) -> str:
    """The MXFP4 layout a dequantized import gives the map: torch's reader's (``P_blocks``,
    unpacked in place) for a map that names ``*_blocks`` tensors, as torchtitan's gpt_oss adapter
    does (and for ``torchtitan:`` adapter maps); transformers' (``P``, dims 1 and 2 swapped)
    otherwise."""
    if isinstance(kmap, AdapterMap):  # torchtitan loads MXFP4 through torch's reader
        return "torch"
    names = [*kmap.from_hf, *kmap.experts]
    return "torch" if any(n.endswith("_blocks") for n in names) else "transformers"


def _dequantize_notes(reader: object, dtype: str | None) -> tuple[str, ...]:
    if dtype is None or not isinstance(reader, DequantizedReader) or reader.pairs:
        return ()
    return (f"--dequantize {dtype}: the checkpoint holds no block-scaled FP8 or MXFP4 tensors; copied as they are",)


@conversion_command("import-hf")
def import_hf(src: str | os.PathLike, dst: str | os.PathLike, *, key_map: str | KeyMap | None = "identity",
              config: str | os.PathLike | Mapping[str, Any] | None = None, prefix: str | None = None,
              options: RunOptions | None = None, chunk_bytes: int | None = None,
              backend: str = "zarr", dequantize: str | None = None) -> ConversionResult:
    """Convert the HF safetensors directory ``src`` into a universal store at ``dst``.

    ``key_map`` renames HF names to native ones (the inverse of the export map); ``config``
    (default: ``src/config.json`` when the map needs head counts) gives the head counts;
    ``prefix`` puts the weights under an object-path root (e.g. ``model`` for DCP's
    ``get_state_dict`` style), top level by default (torchtitan's style). ``backend`` puts the
    tensors' chunks in zarr arrays (default) or safetensors files. ``dequantize`` (``bf16``,
    ``fp32``, ...) writes each block-scaled FP8 or MXFP4 tensor as its dequantized value in that
    dtype (:mod:`converter.run.quant_reader`), its scales left out; without it both are copied as
    they are.
    """
    options = options or RunOptions()
    kmap = get_key_map(key_map)
    if kmap.export_only:
        raise ConfigError(f"--map {kmap.name}: export only (Megatron keeps layers stacked and q/k/v, gate/up fused); "
                          "import-hf cannot write its names")
    if detect_format(src) != "hf":
        raise ConfigError(f"{src}: import-hf reads a Hugging Face directory (*.safetensors); use to-universal for other checkpoints")
    cfg = _import_config(src, kmap, config)
    dq = None if dequantize is None else cast_dtype(dequantize)
    reader = open_checkpoint(src, verify=options.verify_source)
    try:
        if dq is not None:
            reader = DequantizedReader(reader, dq, block_size_of(cfg), mx_layout(kmap))
        index = reader.index()
        sources, paths = plan_import(index, kmap, cfg, prefix)
        view = MappedReader(reader, sources, paths)
        vindex = view.index()
        chunk_bytes = chunk_bytes or universal_chunk_bytes(options)
        store = plan_universal(vindex.tensors, chunk_bytes, backend)
        tasks = store_tasks(vindex.tensors, store, chunk_bytes)  # the same plan for the dry run and the run
        refs, atoms = group_atoms(paths)
        files = [f for f in index.info.get("files", {}) if f.endswith(".safetensors")]
        source = SourceInfo(format="hf", path=source_label(src), world_size=None,
                            layout=f"hf {len(files)} file{'s' if len(files) != 1 else ''}")
        header = {"--map": option_value(key_map), "--config": option_value(cfg), "--prefix": prefix,
                  "--chunk-size": chunk_bytes, **({"--backend": backend} if backend != "zarr" else {}),
                  **({"--dequantize": dq} if dq is not None else {})}
        planned = ConversionResult(str(dst), len(sources), 0, sum(t.nbytes for t in tasks), 0.0,
                                   warnings=(() if isinstance(kmap, AdapterMap) else tied_notes(index, cfg))
                                   + _dequantize_notes(reader, dq)
                                   + adapter_notes(index, kmap))
        return run_conversion(Conversion(
            "import-hf", src, dst, index, view, tasks, header,
            lambda out: universal_output(out, vindex.tensors, refs, store, source, atoms), planned,
            describe=lambda: (describe(tasks), None), expected=PlannedOutput.of_entries(vindex.tensors)), options)
    finally:
        reader.close()
