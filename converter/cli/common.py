"""What every ``ckptconv`` command shares: the size type, the run and selection options, how
options become :class:`converter.config.RunOptions`, and the one-line result printers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from converter.config import RunOptions, parse_size
from formats.errors import CkptConvError

if TYPE_CHECKING:
    from converter.run.pipeline import ConversionResult

EXIT_ERROR = 2
_IMPORTED = __import__("time").time()
EXIT_INTERNAL = 3


class _Size(click.ParamType):
    name = "SIZE"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        try:
            size = parse_size(value)
        except CkptConvError as e:
            self.fail(str(e), param, ctx)
        if size < 1:  # 0 would otherwise read as "use the default" somewhere down the line
            self.fail(f"{value!r}: a size must be positive, e.g. 512MiB", param, ctx)
        return size


SIZE = _Size()


def run_options(f):
    """The execution options every conversion command takes."""
    opts = [
        click.option("--workers", type=int, default=None, help="I/O worker threads (default: CPU count, 2..8)."),
        click.option("--memory-budget", type=SIZE, default=None, help="Bytes of buffers in flight, e.g. 512MiB (default 512MiB)."),
        click.option("--overwrite", is_flag=True, help="Replace a previous ckptconv output (complete or partial) at DST; anything else there is refused."),
        click.option("--resume", is_flag=True, help="Idempotent: continue an interrupted conversion into the same destination (same source "
                     "and options), start it when DST is missing or empty, exit 0 when it is already complete there."),
        click.option("--trust-pickle", is_flag=True, help="Allow non-tensor entries that need arbitrary classes (runs their pickle code)."),
        click.option("--dry-run", is_flag=True, help="Print the plan, write nothing."),
        click.option("--progress/--no-progress", default=None, help="Progress on stderr: a bar on a terminal, else a line every 5 s and one at 100 % "
                     "(under torchrun: each rank's lines prefixed [rank R/N]; default on; --no-progress: none)."),
        click.option("--spool-dir", default=None, help="Local directory to stage a URL destination before upload "
                     "(default: $CKPTCONV_SPOOL_DIR or the temp dir). Universal outputs stream through it (about "
                     "twice --memory-budget); DCP and HF outputs need room for the whole output."),
        click.option("--no-verify-source", "no_verify_source", is_flag=True,
                     help="Skip checking each source chunk's stored checksum (DCP zip CRC-32, universal xxh3) "
                          "while copying it (default: checked; a mismatch stops the run)."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


MAP_HELP = ("Key map: identity (default), torchtitan-llama (HF Llama names, q/k RoPE permutation; exports older and "
            "torchtitan 0.3.0 names, fused qkv_linear.wqkv split; imports older names), torchtitan-llama3 (imports "
            "torchtitan 0.3.0 names: qkv_linear.wq/wk/wv, lm_head), torchtitan-deepseek-v3 / torchtitan-qwen3 (torchtitan "
            "0.3.0's MoE adapters: grouped experts split into model.layers.{}.mlp.experts.{}.*_proj.weight, router "
            "mlp.gate, shared experts), megatron-llama (export: Megatron-core GPT to HF Llama names, "
            "layer-stacked tensors unstacked, linear_qkv / linear_fc1 split), megatron-gpt2 (export: Megatron-core "
            "GPT built GPT-2 style to HF GPT2LMHeadModel names, Conv1D weights transposed, linear_qkv regrouped "
            "to c_attn's [q; k; v]), or a JSON "
            "map file {\"hf.name.{}.x\": \"native.{}.x\", \"dropped.hf.key\": null} or "
            "{\"map\": {...}, \"drop\": [native keys], \"transforms\": {native key: \"rope:<config field>\"}, "
            "\"experts\": {\"hf.{}.experts.{}.w\": \"native.{}.grouped_w\"}}.")


def map_options(f):
    """``--map``, ``--map-direction``, ``--key-style``: a whole training checkpoint (weights,
    optimizer states, param groups) moved to another framework's names."""
    opts = [
        click.option("--map", "key_map", default=None,
                     help="Move the checkpoint to another framework's names: every parameter, each of its optimizer "
                          "states (same-shaped ones through the same transform; step copied) and its param groups. "
                          + MAP_HELP),
        click.option("--map-direction", default="auto", show_default=True,
                     type=click.Choice(["auto", "to-hf", "from-hf"]),
                     help="Which way --map renames: to-hf (native -> Hugging Face names), from-hf, or auto (the side "
                          "of the map that names the source's parameters)."),
        click.option("--key-style", default="auto", show_default=True,
                     type=click.Choice(["auto", "torchtitan", "dcp", "dcp-flat", "source"]),
                     help="Key style of the output: torchtitan (top-level weights, optimizer.state.<fqn>.* flattened), "
                          "dcp (get_state_dict's default: model.<fqn>, optim.state.<fqn>.*, optim.param_groups.<i>.*), "
                          "dcp-flat (flatten_optimizer_state_dict=True: optim.param_groups.<fqn>.*), source (the "
                          "source's), auto (with --map: dcp to HF names, torchtitan from them)."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def map_config_options(f):
    """``--config`` (the head counts a map's row transforms need) and ``--json`` (the dry run's
    key-map plan), for the conversions whose other options have neither."""
    opts = [
        click.option("--config", default=None,
                     help="With --map: config.json (path or inline JSON) with the head counts its row transforms need "
                          "(default: SRC/config.json when present)."),
        click.option("--json", "as_json", is_flag=True,
                     help="With --dry-run --map: print the key-map plan as JSON (schemas/key-map.schema.json)."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def check_map_json(as_json: bool, run_kw: dict[str, Any]) -> None:
    """Refuse ``--json`` without ``--dry-run`` (before anything runs)."""
    if as_json and not run_kw.get("dry_run"):
        from formats.errors import ConfigError

        raise ConfigError("--json prints the key-map plan of a dry run: add --dry-run and --map")


def report_mapped(result: ConversionResult, as_json: bool) -> None:
    """:func:`report_result`, or with ``--json`` the dry run's key-map document."""
    from formats.errors import ConfigError

    if not as_json:
        report_result(result)
        return
    if result.preview is None:
        raise ConfigError("--json prints the key-map plan of a dry run with --map; this one has none")
    for w in result.warnings:
        click.echo(f"ckptconv: warning: {w}", err=True)
    echo_doc(result.preview)


def selection_options(f):
    """``--keys``, ``--model-only``, ``--optim-only``: which entries a conversion copies."""
    opts = [
        click.option("--keys", "keys", multiple=True, metavar="PATTERN",
                     help="Copy only keys matching a glob ('model.layers.0.*') or 're:REGEX'; repeatable (any matches)."),
        click.option("--model-only", is_flag=True,
                     help="Copy model weights and buffers only (no optimizer state, schedulers, step, RNG...)."),
        click.option("--optim-only", is_flag=True, help="Copy the optimizer entries only (states and param groups)."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def make_selection(keys: tuple[str, ...], model_only: bool, optim_only: bool):
    """The :class:`converter.plan.selection.Selection` of the selection options."""
    from converter.plan.selection import selection_from_options

    return selection_from_options(keys, model_only, optim_only)


def make_options(workers, memory_budget, overwrite, resume, trust_pickle, dry_run, progress,
                 spool_dir=None, no_verify_source=False) -> RunOptions:
    from converter import knobs

    return RunOptions(
        workers=knobs.WORKERS if workers is None else workers,  # 0 is refused, not the default
        memory_budget=knobs.MEMORY_BUDGET if memory_budget is None else memory_budget,
        overwrite=overwrite, resume=resume, trust_pickle=trust_pickle, dry_run=dry_run, progress=progress,
        spool_dir=spool_dir, verify_source=not no_verify_source,
    )


def report_result(result: ConversionResult) -> None:
    """Print a conversion's result: its warnings (stderr) first, then the dry run's plan and
    :func:`dry_run_line`, or the :func:`result_line` of a run. Every conversion command ends here."""
    import click

    if result.plan_choice is not None and result.plan is None:  # (a dry run's text says it)
        click.echo(f"ckptconv: {result.plan_choice}", err=True)
    for w in result.warnings:
        click.echo(f"ckptconv: warning: {w}", err=True)
    for step in result.steps:  # every step of a run: one line each
        if step.result is not None and result.plan is None:
            click.echo(f"{step.name}: {step.status}: {result_line(step.result)}")
        elif result.plan is None:
            click.echo(f"{step.name}: {step.status}" + (f" ({step.detail})" if step.detail else ""))
    if result.plan is not None:
        click.echo(result.plan)
        click.echo(dry_run_line(result))
        return
    if result.already_complete:
        click.echo(f"{result.dst}: already complete (this same conversion finished there before); nothing written")
        return
    click.echo(result_line(result))


def echo_doc(doc: Any) -> None:
    """Print a JSON document (a report's ``--json``) on stdout, indented."""
    import json

    import click

    click.echo(json.dumps(doc, indent=1, default=str))


def dry_run_line(result: ConversionResult) -> str:
    """The last line of a ``--dry-run``: what would be written."""
    from converter.units import human_bytes, plural

    return (f"# dry run: {plural(result.tensors, 'tensor')}, {plural(result.objects, 'object')}, "
            f"{human_bytes(result.bytes)} ({result.bytes} bytes); nothing written")


def result_line(result: ConversionResult) -> str:
    """The end-of-run summary of a conversion (one line on stdout): what was written (entries,
    bytes, files), the target mesh and world size, the processes that did it, the wall time since
    this process started (what ``time`` reports, start-up included) and the rate over it."""
    from converter.run import distributed
    from converter.units import human_bytes, human_rate, plural

    files = count_files(result.dst)
    where = f" in {plural(files, 'file')}" if files is not None else ""
    parts = [f"wrote {result.dst}: {plural(result.tensors, 'tensor')}, {plural(result.objects, 'object')}, "
             f"{human_bytes(result.bytes)}{where}"]
    if result.mesh:
        parts.append(f"mesh {result.mesh} (world size {result.world_size})")
    wall = process_seconds()
    procs = distributed.env_world()[1]
    parts.append(f"{plural(procs, 'process', 'processes')}, {wall:.2f} s wall, {human_rate(result.bytes, wall)}")
    return "; ".join(parts)


def process_seconds() -> float:
    """Seconds since this process started, as ``time`` measures it: on Linux from the kernel's
    own clocks (``/proc/uptime`` minus the process start in ``/proc/self/stat``, both since boot:
    psutil's start time adds the whole-second rounding of the boot time), else psutil's, else
    since this module was imported."""
    import os
    import time

    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil

        return max(0.0, time.time() - psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - a summary must never fail a finished conversion
        return time.time() - _IMPORTED


def count_files(dst: str) -> int | None:
    """Checkpoint files under a local output directory, not counting ckptconv's bookkeeping (its
    output record and loads manifest; None for a URL or a missing path); a DCP output's count is
    the dry run's (ranks + .metadata)."""
    import os

    from converter.run.destination import LOADS_MANIFEST, OUTPUT_RECORD

    if "://" in str(dst) or not os.path.isdir(dst):
        return None
    return sum(len(set(names) - {OUTPUT_RECORD, LOADS_MANIFEST}) for _, _, names in os.walk(dst))
