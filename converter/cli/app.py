"""The ``ckptconv`` command line (click). Every command calls the Python API in ``converter.api``.

Errors: a :class:`formats.errors.CkptConvError` prints one line ``ckptconv: error: ...`` and exits
with status 2; an :class:`~formats.errors.InternalError` (ckptconv's check of its own output
failed) and anything else are internal errors (status 3). ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from converter import __version__
from converter.cli import hf as hf_commands
from converter.cli import tools as tool_commands
from converter.cli import ds as ds_commands
from converter.cli.common import (EXIT_ERROR, EXIT_INTERNAL, SIZE, echo_doc, make_options, make_selection,
                                 report_result, run_options, selection_options, check_map_json, map_config_options,
                                 map_options, report_mapped)
from formats.errors import CkptConvError, InternalError

@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckptconv")
@click.option("--debug", is_flag=True, help="Show tracebacks on errors.")
@click.option("--ds-tp-rules", "ds_tp_rules", default=None, metavar="RULES.json",
              help="How a tensor-parallel DeepSpeed save's mp_rank slices join when it records no "
                   "universal_checkpoint_info: JSON with ds_to_universal's pattern keys (README); "
                   "also $CKPTCONV_DS_TP_RULES.")
@click.pass_context
def cli(ctx: click.Context, debug: bool, ds_tp_rules: str | None) -> None:
    """Offline, model-free conversion of PyTorch Distributed Checkpoints."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    if ds_tp_rules is not None:  # read (and checked) by the DeepSpeed reader, in this process and its workers
        from formats.deepspeed_zero.tp import RULES_ENV

        before = os.environ.get(RULES_ENV)
        os.environ[RULES_ENV] = os.path.abspath(ds_tp_rules)
        ctx.call_on_close(lambda: os.environ.pop(RULES_ENV) if before is None else os.environ.update({RULES_ENV: before}))


@cli.command("to-universal")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--chunk-size", type=SIZE, default=None, help="Target bytes per chunk (default 64MiB).")
@click.option("--backend", type=click.Choice(["zarr", "safetensors"]), default="zarr", show_default=True,
              help="Where the store keeps tensor bytes: zarr arrays (stock zarr opens them) or safetensors files "
                   "(a file per chunk; safetensors.safe_open opens them).")
@map_config_options
@map_options
@selection_options
@run_options
def to_universal_cmd(src: str, dst: str, chunk_size: int | None, backend: str, config: str | None, as_json: bool,
                     key_map: str | None, map_direction: str, key_style: str, keys: tuple[str, ...],
                     model_only: bool, optim_only: bool, **kw: Any) -> None:
    """Convert a DCP checkpoint SRC into a universal store DST (Zarr v3, or safetensors with --backend)."""
    from converter.api import to_universal

    check_map_json(as_json, kw)
    selection = make_selection(keys, model_only, optim_only)
    options = make_options(**kw)
    report_mapped(to_universal(src, dst, options, chunk_bytes=chunk_size, selection=selection, backend=backend,
                               key_map=key_map, map_direction=map_direction, key_style=key_style, config=config),
                  as_json)


@cli.command("inspect")
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (schemas/inspect.schema.json).")
@click.option("--key", "key_pattern", default=None, help="Only keys matching this glob (or 're:REGEX').")
@click.option("--stats", "stats_keys", multiple=True, help="Tensor statistics of KEY (streamed); repeatable, globs allowed.")
@click.option("--layout", "layout_key", default=None, help="Draw which rank/file holds which region of tensor KEY (a key, glob or 're:REGEX').")
@click.option("--svg", "svg_file", default=None, metavar="FILE",
              help="With --layout: write the picture as an SVG file (with --vs: the two checkpoints side by side).")
@click.option("--vs", "vs_path", default=None, metavar="OTHER",
              help="With --layout: also draw KEY as checkpoint OTHER holds it (e.g. the source of a conversion).")
@click.option("--trust-pickle", is_flag=True, help="Allow previews of non-tensor entries that need arbitrary classes.")
def inspect_cmd(path: str, as_json: bool, key_pattern: str | None, stats_keys: tuple[str, ...],
                layout_key: str | None, svg_file: str | None, vs_path: str | None, trust_pickle: bool) -> None:
    """Show what is inside a checkpoint (DCP directory, universal store or HF safetensors directory)."""
    from rich.console import Console

    from converter.tools.inspect import build_report, key_matcher, no_match_message, render_report, render_stats
    from converter.run.sources import open_checkpoint
    from converter.tools.stats import tensor_stats

    if (svg_file or vs_path) and layout_key is None:
        from formats.errors import ConfigError

        raise ConfigError(f"{'--svg' if svg_file else '--vs'} draws a tensor's layout: add --layout KEY")
    from formats.dcp.metadata import gc_paused

    pause = gc_paused()  # the index and the report are millions of small acyclic objects at scale:
    pause.__enter__()  # no cyclic GC passes over them (the reports are built, printed, and dropped)
    try:
        reader = open_checkpoint(path, trust_pickle=trust_pickle, verify=bool(stats_keys))  # --stats reads: check them
    except BaseException:
        pause.__exit__(None, None, None)
        raise
    try:
        index = reader.index()
        stats = []
        for pattern in stats_keys:
            keys = [k for k in index.tensors if key_matcher(pattern)(k)] or _missing_key(no_match_message(index, pattern))
            stats += [tensor_stats(reader, k) for k in keys]
        if as_json:
            doc = build_report(reader, key_pattern)
            if stats:
                doc = {**doc, "stats": [s.to_json() for s in stats]}
            echo_doc(doc)
            return
        console = Console()
        if layout_key is not None:
            sides = [(path, index)]
            if vs_path is not None:
                other = open_checkpoint(vs_path, trust_pickle=trust_pickle)
                try:
                    sides.append((vs_path, other.index()))
                finally:
                    other.close()
            draw_layouts(sides, layout_key, svg_file, console)
        elif not stats:
            render_report(build_report(reader, key_pattern), console)
        if stats:
            render_stats(stats, console)
    finally:
        reader.close()
        pause.__exit__(None, None, None)


def draw_layouts(sides: list[tuple[str, Any]], pattern: str, svg_file: str | None, console: Any,
                 key_side: int = 0) -> None:
    """The layout of every key ``pattern`` selects (in side ``key_side``'s index), as each side
    holds it: text pictures one after another, or one SVG with the sides next to each other."""
    from converter.tools.inspect import layout_keys, no_match_message, render_layout

    keys = layout_keys(sides[key_side][1], pattern)
    for name, index in sides:
        missing = [k for k in keys if k not in index.tensors]
        if missing:
            from formats.errors import ConfigError

            raise ConfigError(no_match_message(index, missing[0]) + f" (it is in {sides[key_side][0]})")
    if svg_file is None:
        for key in keys:
            for name, index in sides:
                if len(sides) > 1:
                    console.print(f"[dim]# {name}[/dim]", soft_wrap=True, highlight=False)
                render_layout(index, key, console)
        return
    from converter.plan.source_layout import detect_layout
    from converter.tools.svg import Panel, write_svg
    from converter.units import plural

    layouts = [detect_layout(index) for _, index in sides]
    rows = []
    for key in keys:
        row = []
        for (name, index), lay in zip(sides, layouts):
            e = index.tensors[key]
            sub = (f"{key}  {e.dtype}  {tuple(e.shape)}\n{plural(len(e.chunks), 'chunk')}  ({lay.tensors[key].kind})\n"
                   f"checkpoint: {lay.summary}")
            row.append(Panel(name, sub, e))
        rows.append(row)
    write_svg(svg_file, rows)
    click.echo(f"wrote {svg_file}: {plural(len(keys), 'tensor')} x {plural(len(sides), 'checkpoint')}")


def _missing_key(message: str) -> list[str]:
    from formats.errors import ConfigError

    raise ConfigError(message)


@cli.command("from-universal")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--mesh", required=True, help="Target mesh, e.g. tp2,dp32 or pp2,dp_replicate2,dp4 (names: pp, dp_replicate, dp/dp_shard, cp, tp).")
@click.option("--mesh-order", default=None, help="Rank order of the mesh dims, outermost first (default: pp,dp_replicate,dp_shard,cp,tp).")
@click.option("--plan", "plan_name", default="auto", show_default=True, help="Placement plan: auto (chosen from the checkpoint: Megatron names (megatron-core where its training args build the model, else megatron), else the source's own TP layout, else the model family from its names, else fsdp; printed with the reason), fsdp, llama, moe, megatron, source, megatron-core (megatron-core's own sharded_state_dict() of the model the checkpoint's args build), torchtitan:MODEL/FLAVOR or python:MODULE:FUNCTION (read from the model's own parallelize code), or a plan file (JSON/YAML).")
@click.option("--dtype", default=None, help="Cast floating-point parameters: bf16, fp16, fp32, fp64 (or bfloat16, float16, ...); float8/int kept. Off by default.")
@click.option("--drop-dataloader-state", "drop_dataloader", is_flag=True,
              help="Leave out the per-rank dataloader state (needed when the DP degree changes: torchtitan cannot reshard it); "
                   "torchtitan gets an empty one per new DP rank and restarts its data.")
@click.option("--config", default=None,
              help="Model config.json (path or inline JSON) with the attention head counts a TP split must divide "
                   "(default: SRC/config.json when present).")
@click.option("--layout-bound-objects", "layout_objects", type=click.Choice(["drop", "keep", "refuse"]), default="drop",
              show_default=True,
              help="Megatron entries saved per (pp, tp) grid cell (rng_state, the dp_reshardable optimizer state, ...) when "
                   "the target's pp/tp differ from the source's: drop them with a warning (Megatron-LM skips RNG states "
                   "after a TP/PP change and loads without that optimizer state with --no-load-optim), keep them, or refuse.")
@click.option("--format", "out_format", type=click.Choice(["dcp", "dcp-safetensors", "megatron-legacy"]), default="dcp",
              show_default=True,
              help="DCP storage form: dcp (.metadata + __<rank>_0.distcp, FileSystemWriter) or dcp-safetensors "
                   "(per-rank shard-<R>-model-<F>-of-<N>.safetensors, HuggingFaceStorageWriter(save_distributed=True); "
                   "load with HuggingFaceStorageReader; tensors only); or megatron-legacy: Megatron-LM's legacy "
                   "checkpoint (--ckpt-format torch: iter_*/mp_rank_*/model_optim_rng.pt + distrib_optim.pt) for "
                   "--mesh tp,pp,dp[,ep] from a Megatron source (torch_dist, legacy, or their universal store).")
@click.option("--vpp", type=int, default=1, show_default=True,
              help="With --format megatron-legacy or --plan megatron-core: model chunks per pipeline stage (virtual "
                   "pipeline; legacy files hold model0, model1, ...).")
@click.option("--megatron-names", type=click.Choice(["local", "te"]), default=None,
              help="With --format megatron-legacy: the layer spec whose names the files use (local: input_layernorm / "
                   "pre_mlp_layernorm; te: Transformer Engine's fused names; default: the checkpoint's "
                   "args.transformer_impl, else te).")
@click.option("--consolidate", is_flag=True,
              help="With --format dcp-safetensors: the per-rank files go to DST/sharded/ and the hub-shaped files torch's "
                   "consolidate_safetensors_files makes of them (model-0000F-of-0000N.safetensors + index) are written "
                   "to DST in the same run.")
@click.option("--max-shard-size", default=None, metavar="SIZE",
              help="With --format dcp-safetensors: split the keys into files of at most SIZE (e.g. 5GB; torch's "
                   "fqn_to_index_mapping; default one file).")
@click.option("--fqn-index", default=None, metavar="FILE",
              help="With --format dcp-safetensors: torch's fqn_to_index_mapping, from a hub model.safetensors.index.json "
                   "(or its folder; each file's number is the index, as torchtitan reads it) or JSON {key: index}: the "
                   "file of every key and the consolidated order.")
@click.option("--local-files", type=click.Choice(["dedup", "rank", "node"]), default="dedup", show_default=True,
              help="Where a box several ranks hold goes: dedup (written once, in the least-loaded holder's file, one "
                   ".metadata: what dcp.save writes), rank (every rank's file also holds the replicated boxes and "
                   "non-tensor entries it loads, and __<rank>.metadata maps them: each rank's dcp.load opens only its own "
                   "two files) or node (the same per node of --ranks-per-node ranks). 'ckptconv files DST --rank R' "
                   "lists what a rank opens.")
@click.option("--ranks-per-node", type=int, default=None, metavar="K",
              help="With --local-files node: ranks per node (node N holds ranks N*K .. N*K+K-1).")
@click.option("--node-local-dst", is_flag=True,
              help="With --local-files node, under torchrun --nnodes N --nproc-per-node K (the target job's shape): DST "
                   "is on each node's own storage (e.g. /local/ckpt); each node writes there only its node's files and "
                   "__<R>.metadata, and marks its folder complete when they are.")
@click.option("--json", "as_json", is_flag=True,
              help="With --dry-run: print the target plan as JSON (schemas/target-plan.schema.json).")
@click.option("--layout", "layout_key", default=None, metavar="KEY",
              help="With --dry-run: draw which rank/file will hold which region of KEY (a key, glob or 're:REGEX'), "
                   "the picture 'inspect --layout' draws of the output.")
@click.option("--svg", "svg_file", default=None, metavar="FILE",
              help="With --dry-run --layout KEY: write source and target side by side as an SVG file.")
@map_options
@selection_options
@run_options
def from_universal_cmd(src: str, dst: str, mesh: str, mesh_order: str | None, plan_name: str,
                       dtype: str | None, drop_dataloader: bool, config: str | None, layout_objects: str,
                       out_format: str, consolidate: bool, max_shard_size: str | None, fqn_index: str | None,
                       vpp: int, megatron_names: str | None, local_files: str, ranks_per_node: int | None,
                       node_local_dst: bool, as_json: bool, layout_key: str | None, svg_file: str | None,
                       key_map: str | None, map_direction: str, key_style: str, keys: tuple[str, ...],
                       model_only: bool, optim_only: bool, **kw: Any) -> None:
    """Write from SRC (universal store or any checkpoint) the DCP checkpoint a job on --mesh would save."""
    from converter.api import from_universal

    selection = make_selection(keys, model_only, optim_only)
    if svg_file is not None and layout_key is None:
        from formats.errors import ConfigError

        raise ConfigError("--svg draws a tensor's layout: add --dry-run --layout KEY")
    if (as_json or layout_key is not None) and not kw.get("dry_run"):
        from formats.errors import ConfigError

        raise ConfigError(f"{'--json' if as_json else '--layout'} shows the plan of a dry run: add --dry-run "
                          f"(after the conversion, use 'ckptconv inspect {dst} --layout KEY')")
    from converter.plan.dry_run import PREVIEW_CHUNK_LINES

    result = from_universal(src, dst, mesh, plan=plan_name, mesh_order=mesh_order, dtype=dtype,
                            options=make_options(**kw), selection=selection, drop_dataloader=drop_dataloader,
                            config=config, layout_objects=layout_objects, format=out_format,
                            consolidate=consolidate, max_shard_size=max_shard_size, fqn_index=fqn_index,
                            vpp=vpp, megatron_names=megatron_names, local_files=local_files,
                            ranks_per_node=ranks_per_node, key_map=key_map, map_direction=map_direction,
                            key_style=key_style, node_local_dst=node_local_dst,
                            # the text lists a few chunks per key; --json / --layout all
                            preview_chunks=None if as_json or layout_key is not None else PREVIEW_CHUNK_LINES)
    if result.preview is not None and (as_json or layout_key is not None):
        for w in result.warnings:
            click.echo(f"ckptconv: warning: {w}", err=True)
        _show_preview(result.preview, as_json, layout_key, svg_file, src, kw.get("trust_pickle", False))
        return
    if node_local_dst and os.environ.get("LOCAL_RANK", "0") == "0":
        sys.stdout = sys.__stdout__  # each node's first process reports its node's folder
    report_result(result)


def _show_preview(doc: dict, as_json: bool, layout_key: str | None, svg_file: str | None, src: str,
                  trust_pickle: bool) -> None:
    """``--dry-run --json`` / ``--dry-run --layout KEY [--svg FILE]``: the plan document, or the
    target picture (with ``--svg``: the source and the target side by side)."""
    if as_json:
        echo_doc(doc)
        return
    from rich.console import Console

    from converter.plan.dry_run import preview_index

    target = (f"{doc['dst']} (planned, mesh {doc['mesh']['spec']})", preview_index(doc))
    if svg_file is None:
        draw_layouts([target], layout_key, None, Console())
        return
    from converter.run.sources import open_checkpoint

    reader = open_checkpoint(src, trust_pickle=trust_pickle)
    try:
        source = (src, reader.index())
    finally:
        reader.close()
    draw_layouts([source, target], layout_key, svg_file, Console(), key_side=1)  # the target's keys (--keys narrows)


@cli.command("demo")
@click.option("--workdir", type=click.Path(), default=None, help="Where to write the demo outputs (default: a temp dir).")
def demo_cmd(workdir: str | None) -> None:
    """Run the whole pipeline on the bundled demo checkpoint (FSDP2, 2 ranks)."""
    from converter.tools.demo import run_demo

    run_demo(workdir)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI, turning errors into one line and an exit status.

    As the process entry point (``argv`` None) a successful command ends the process at once
    (``os._exit`` after flushing stdout and stderr): every output is already durable, and
    interpreter teardown (torch's finalizers) costs seconds. Called with ``argv`` (tests,
    embedding), it returns normally.
    """
    if argv is not None:
        _run(argv)
        return
    from converter.run import timings

    timings.mark("imports")
    _stop_on_sigterm()
    _raise_open_file_limit()
    try:
        rv = _run(argv)
    except SystemExit as e:  # errors too: skipping the teardown makes Ctrl-C / SIGTERM exit at once
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        _exit_now(code)
    _exit_now(rv if isinstance(rv, int) else 0)


def _raise_open_file_limit() -> None:
    """Readers keep one open file per source file, and a 1,024-rank checkpoint has more files than
    the usual soft limit (1,024): raise the soft limit to the hard one, as far as the OS allows."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        if soft != resource.RLIM_INFINITY and target > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):  # not POSIX, or the OS refuses: keep the limit
        pass


def _stop_on_sigterm() -> None:
    """SIGTERM stops a run like Ctrl-C (workers stop, the journal is kept for --resume), exit 143."""
    import signal

    from converter.run.destination import Terminated

    def handler(signum: int, frame: Any) -> None:
        raise Terminated()

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        pass


def _exit_now(code: int) -> None:
    import os

    from converter.run import timings

    timings.report()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe must not turn success into a traceback
            pass
    os._exit(code)


def _run(argv: list[str] | None) -> object:
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        _join_torchrun()
        return cli.main(args=argv, prog_name="ckptconv", standalone_mode=False)
    except click.exceptions.Abort as e:  # click's form of a KeyboardInterrupt (its __cause__)
        _aborted(e.__cause__)
    except click.ClickException as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # bare 'ckptconv' / 'ckptconv CMD': the help is the answer
            click.echo(e.format_message())
        else:
            click.echo(f"ckptconv: error: {usage_error_text(e)}", err=True)
        sys.exit(EXIT_ERROR)
    except InternalError as e:  # a check of ckptconv's own work failed: a bug (status 3)
        if debug:
            raise
        click.echo(f"ckptconv: {e}", err=True)
        sys.exit(EXIT_INTERNAL)
    except CkptConvError as e:
        if debug:
            raise
        click.echo(f"ckptconv: error: {e}", err=True)
        sys.exit(EXIT_ERROR)
    except KeyboardInterrupt as e:
        _aborted(e)
    except OSError as e:  # a path the readers did not foresee (permissions, loops, long names): the user's to fix
        if debug:
            raise
        from formats.fsutil import os_reason, short

        where = f"{short(e.filename)}: " if e.filename else ""
        click.echo(f"ckptconv: error: {where}{os_reason(e)}; check the path and its permissions", err=True)
        sys.exit(EXIT_ERROR)
    except Exception as e:  # noqa: BLE001 - last line of defence: one line, no traceback
        if debug:
            raise
        msg = str(e).splitlines()[0] if str(e) else ""
        click.echo(f"ckptconv: internal error: {type(e).__name__}: {msg} (rerun with --debug for a traceback)", err=True)
        sys.exit(EXIT_INTERNAL)
    finally:
        from converter.run import distributed

        distributed.current().shutdown()


def usage_error_text(e: click.ClickException) -> str:
    """A click usage error as one line: the message, then where to read the usage."""
    msg = " ".join(e.format_message().split()).rstrip(".")
    ctx = getattr(e, "ctx", None)
    where = f"'{ctx.command_path} --help'" if ctx is not None else "'ckptconv --help'"
    return f"{msg}; see {where}"


def _aborted(e: BaseException | None) -> None:
    """One line for Ctrl-C or SIGTERM (:class:`converter.run.destination.Interrupted` says whether
    ``--resume`` continues the run), exit status 128 + the signal number (130, 143)."""
    import signal

    signum = getattr(e, "signum", signal.SIGINT)
    text = str(e) if e is not None and str(e) else \
        f"aborted ({'terminated' if signum == signal.SIGTERM else 'interrupted'})"
    click.echo(f"ckptconv: {text}", err=True)
    sys.exit(128 + signum)


def _join_torchrun() -> None:
    """Under torchrun (WORLD_SIZE > 1) join the job; only rank 0 prints results (errors: every rank)."""
    from converter.run import distributed

    if distributed.env_world()[1] <= 1:
        return
    dist = distributed.init_from_env()
    if not dist.leader:
        import io

        sys.stdout = io.StringIO()


hf_commands.register(cli)
tool_commands.register(cli)
ds_commands.register(cli)
