"""export-hf: a universal store or DCP checkpoint -> Hugging Face ``model.safetensors`` (or shards
and an index).

The plan (:mod:`converter.plan.hf_export`) names every HF tensor, its source tensor, dtype and row
permutation; the source is read through a :class:`~converter.run.mapped_reader.MappedReader` (a
view whose index names the HF tensors), so every HF tensor is one write task whose pieces are
streamed into the file at their offsets (:class:`formats.hf.HFWriter`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from converter import __version__
from converter.config import RunOptions, parse_size
from converter.plan.copy_tasks import describe, plan_tensor
from converter.plan.hf_config import CONFIG_FILE, config_bytes, load_config_arg
from converter.plan.hf_export import plan_export, shard_summary
from converter.plan.hf_like import plan_like
from converter.plan.hf_quant import check_kind, plan_quantize, quantized_config, scales_after_weights
from converter.plan.key_maps import KeyMap, get_key_map
from converter.run.cross_view import map_config
from converter.run.destination import option_value, write_output_record
from converter.run.journal import index_fingerprint
from converter.run.mapped_reader import MappedReader
from converter.run.quant_reader import QuantizingReader, QuantTarget
from converter.run.steps import find_steps, is_pattern, run_steps, steps_failure
from converter.run.pipeline import (Conversion, ConversionResult, Output, PlannedOutput,
                                     conversion_command, run_conversion)
from converter.run.sinks import hf_output
from converter.run.sources import open_checkpoint
from formats.base import CheckpointIndex, CheckpointReader, full_box
from formats.dtypes import by_name, cast_dtype
from formats.errors import ConfigError, CorruptCheckpointError
from formats.fsutil import atomic_write_bytes
from formats.hf import DEFAULT_MAX_SHARD_BYTES, SINGLE_FILE, HFWriter, is_hf_checkpoint, plan_files
from formats.quant import block_size_of


def normalize_dtype(dtype: str | None) -> str | None:
    """``bf16`` / ``bfloat16`` / ``torch.bfloat16`` -> ``bfloat16`` (:func:`formats.dtypes.cast_dtype`)."""
    return None if dtype is None else cast_dtype(dtype)


@conversion_command("export-hf")
def export_hf(src: str | os.PathLike, dst: str | os.PathLike, *, key_map: str | KeyMap | None = "identity",
              max_shard_size: int | str | None = None, dtype: str | None = None,
              config: str | os.PathLike | Mapping[str, Any] | None = None,
              options: RunOptions | None = None, quantize: str | None = None,
              like: str | os.PathLike | None = None, all_steps: bool = False) -> ConversionResult:
    """Write the model weights of ``src`` (universal store or DCP) as HF safetensors in ``dst``.

    ``key_map``: ``identity``, ``torchtitan-llama`` or a map file; ``max_shard_size``: bytes or
    text like ``5GB`` (huggingface_hub's default); ``dtype``: cast floating-point weights (e.g.
    ``bf16``); ``config``: a config.json path or inline JSON, written to ``dst/config.json``
    (completed from the weights' shapes for the built-in Llama map) and used for head counts.
    ``quantize="fp8-block"`` writes the chosen weights as block-scaled FP8 plus their
    ``weight_scale_inv`` (:mod:`converter.plan.hf_quant`; block from the config's
    ``quantization_config.weight_block_size``, default 128 x 128). ``like``: an HF model
    directory whose files, dtypes, FP8 weights and non-weight files the export takes
    (:mod:`converter.plan.hf_like`; its config.json gives the head counts unless ``config`` does).
    ``all_steps`` (or a glob ``src`` such as ``run/step-*``): every step folder of the run
    directory ``src`` into ``dst/<step>`` (:mod:`converter.run.steps`: done steps skipped,
    interrupted ones resumed, each checked).
    """
    options = options or RunOptions()
    if all_steps or (is_pattern(src) and not Path(src).exists()):
        return _export_steps(src, dst, options, dict(key_map=key_map, max_shard_size=max_shard_size, dtype=dtype,
                                                     config=config, quantize=quantize, like=like))
    kmap = get_key_map(key_map)
    _check_like(like, max_shard_size, dtype, quantize)
    max_bytes = parse_size(DEFAULT_MAX_SHARD_BYTES if max_shard_size is None else max_shard_size)
    if max_bytes < 1:
        raise ConfigError(f"--max-shard-size must be positive (got {max_shard_size!r})")
    dtype = normalize_dtype(dtype)
    check_kind(quantize)
    cfg, cfg_raw = load_config_arg(config)
    base = None if like is None else _open_base(like)
    reader = open_checkpoint(src, trust_pickle=options.trust_pickle, verify=options.verify_source)
    try:
        index = reader.index()
        cfg = map_config(kmap, cfg, reader, index)
        plan = plan_export(index, kmap, dtype, cfg if base is None or config is not None else _heads(base.config))
        view: CheckpointReader = MappedReader(reader, plan.sources)
        specs, out_config, layout, warnings = plan.specs, plan.config, None, plan.warnings
        qspecs = None
        if quantize is not None:
            block = block_size_of(cfg, "--config")
            qspecs = plan_quantize(plan.specs, block, cfg)
            out_config = None if out_config is None else quantized_config(out_config, block)
        if base is not None:
            lp = plan_like(plan.specs, base.index, base.config, str(like))
            qspecs, layout = lp.quantized, lp.layout
            warnings += tuple(f"{n} left out: the base ties it to the embedding (tie_word_embeddings)" for n in lp.dropped)
            out_config = out_config if config is not None else None
        if qspecs is not None:
            view = QuantizingReader(view, {n: QuantTarget(kind, w, qspecs.block) for n, (kind, w) in qspecs.targets.items()})
            specs = qspecs.specs
        if base is not None:
            specs = lp.specs
        file_plans = plan_files(specs, max_bytes, layout=layout)
        entries = view.index().tensors
        order = specs if qspecs is None else scales_after_weights(specs, qspecs.targets, 2 * options.workers)
        tasks = [t for s in order
                 for t in plan_tensor(entries[s.name], [(s.name, full_box(s.shape))], options.effective_piece_bytes)]
        total = sum(s.nbytes for s in specs)
        dtypes = {s.name: by_name(s.dtype).name for s in specs}

        def open_output(out: Path) -> Output:
            def write_config() -> None:
                if base is not None:  # the base's non-weight files (its config.json unless --config)
                    for name in base.files:
                        if not (name == CONFIG_FILE and out_config is not None):
                            atomic_write_bytes(out / name, (base.root / name).read_bytes())
                if out_config is not None:
                    same = cfg_raw is not None and out_config == cfg
                    atomic_write_bytes(out / CONFIG_FILE, cfg_raw if same else config_bytes(out_config))

            own_files = [] if base is None else [*base.files, *(f for p in file_plans for f in (p.name, f"{p.name}.tmp"))]

            def record() -> None:
                if base is not None:
                    write_output_record(out, {"op": "export-hf", "tool": __version__}, own_files)

            return hf_output(HFWriter(out, specs, max_bytes, layout=layout), dtypes, total, write_config, record,
                             record_files=own_files)

        header = {"--map": option_value(key_map), "--dtype": dtype, "--max-shard-size": max_bytes,
                  "--config": option_value(cfg), **({"--quantize": quantize} if quantize else {}),
                  **({"--like": f"{like} (index {index_fingerprint(base.index)})"} if base is not None else {})}
        planned = ConversionResult(str(dst), len(specs), 0, total, 0.0, warnings=warnings)
        return run_conversion(Conversion(
            "export-hf", src, dst, index, view, tasks, header, open_output, planned,
            describe=lambda: (shard_summary(file_plans) + "\n" + describe(tasks), None),
            expected=PlannedOutput.of((s.name, s.dtype, s.shape) for s in specs)), options)
    finally:
        reader.close()


def _export_steps(src: str | os.PathLike, dst: str | os.PathLike, options: RunOptions,
                  kwargs: dict[str, Any]) -> ConversionResult:
    """Every step folder of ``src`` exported into ``dst/<step>`` (:func:`converter.run.steps.run_steps`)."""
    get_key_map(kwargs["key_map"])  # bad options fail before any step
    check_kind(kwargs["quantize"])
    _check_like(kwargs["like"], kwargs["max_shard_size"], kwargs["dtype"], kwargs["quantize"])
    steps = find_steps(src, dst)
    outcomes = run_steps(steps, lambda s, d, o: export_hf(s, d, options=o, **kwargs), _check_step, options)
    error = steps_failure(outcomes)
    if error is not None:
        raise error
    done = [o.result for o in outcomes if o.result is not None]
    notes = tuple(f"step {o.name}: source still being written ({o.detail}); skipped" for o in outcomes
                  if o.status == "incomplete")
    plan = None
    if options.dry_run:
        plan = "\n".join(f"# step {o.name} -> {Path(dst) / o.name}: {o.status}" + (f"\n{o.result.plan}" if o.result else "")
                          for o in outcomes)
    return ConversionResult(str(dst), sum(r.tensors for r in done), 0, sum(r.bytes for r in done),
                            sum(r.seconds for r in done), plan=plan, warnings=notes, steps=tuple(outcomes))


def _check_step(out: Path, result: ConversionResult) -> None:
    """A step's export read back: headers, coverage and index valid, every tensor there."""
    from formats.hf import HFReader

    with HFReader(out) as written:
        n = len(written.index().tensors)
    if n != result.tensors:
        raise CorruptCheckpointError(f"{out}: {n} tensors read back but {result.tensors} were written; "
                                     "rerun with --overwrite")


#: The fields of a base's config.json an ``--like`` export reads (head counts for the maps' splits
#: and permutations); the rest of it is the base's, copied as it is.
HEAD_FIELDS = ("num_attention_heads", "num_key_value_heads", "head_dim", "n_head")


def _heads(config: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return None if config is None else {k: config[k] for k in HEAD_FIELDS if k in config}


class _Base(NamedTuple):
    """An ``--like`` base model directory: its HF index, config and non-weight files."""

    root: Path
    index: CheckpointIndex
    config: dict[str, Any] | None
    files: tuple[str, ...]


def _check_like(like: Any, max_shard_size: Any, dtype: Any, quantize: Any) -> None:
    """Refuse the options ``--like`` decides itself."""
    if like is None:
        return
    for name, value in (("--max-shard-size", max_shard_size), ("--dtype", dtype), ("--quantize", quantize)):
        if value is not None:
            raise ConfigError(f"--like and {name} contradict each other: the base's files, dtypes and FP8 weights "
                              f"are kept; drop {name}")


def _open_base(like: str | os.PathLike) -> _Base:
    """The base model directory of ``--like`` (a local HF directory)."""
    from formats.hf import HFReader, companion_files
    from formats.storage import is_remote

    if is_remote(like):
        raise ConfigError(f"--like {like}: the base model must be a local directory")
    root = Path(like)
    if not is_hf_checkpoint(root):
        raise ConfigError(f"--like {like}: not a Hugging Face model directory (no *.safetensors)")
    with HFReader(root) as base:
        index = base.index()
    if not index.info.get("sharded") and next(iter(index.info["files"]), SINGLE_FILE) != SINGLE_FILE:
        raise ConfigError(f"--like {like}: one safetensors file not named {SINGLE_FILE} and no index; "
                          "transformers loads neither: name it model.safetensors or add the index")
    cfg = load_config_arg(root)[0] if (root / CONFIG_FILE).is_file() else None
    return _Base(root, index, cfg, tuple(companion_files(root)))
