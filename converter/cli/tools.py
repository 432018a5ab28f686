"""``ckptconv verify``, ``ckptconv diff`` and ``ckptconv files`` (registered on the main group by :func:`register`;
they call :func:`converter.api.verify` / :func:`converter.api.diff`).

Exit status: 0 when the checkpoint is sound (verify) or the checkpoints match (diff), 1 when
not, 2 on an error (no such checkpoint, bad options), like ``cmp``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click

from converter.cli.common import echo_doc

EXIT_FOUND = 1


@click.command("verify")
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (schemas/verify.schema.json).")
@click.option("--quick", is_flag=True, help="Structure and completeness only; read no tensor data.")
@click.option("--workers", type=int, default=None, help="Checking threads (default: CPU count, 2..8).")
@click.option("--trust-pickle", is_flag=True, help="Also load non-tensor entries that need arbitrary classes (runs their pickle code).")
def verify_cmd(path: str, as_json: bool, quick: bool, workers: int | None, trust_pickle: bool) -> None:
    """Check that the checkpoint at PATH is sound (DCP, universal store or HF directory).

    Universal: schema, completeness, every chunk's xxh3_64. DCP: chunk coverage, files, the zip
    CRC-32 of every chunk archive. HF: headers, coverage, index (safetensors has no checksums, so
    flipped data bytes cannot be found there). Exit status 0 only when sound, 1 when not.
    """
    from converter.api import verify
    from converter.tools.verify import render_text

    report = verify(path, quick=quick, trust_pickle=trust_pickle, workers=_workers(workers))
    _finish(report, render_text, as_json, report.ok)


@click.command("diff")
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path())
@click.option("--atol", type=float, default=0.0, show_default=True, help="Absolute tolerance: |a-b| <= atol + rtol*|b|.")
@click.option("--rtol", type=float, default=0.0, show_default=True, help="Relative tolerance.")
@click.option("--key", "key_pattern", default=None, help="Only keys matching this glob (or 're:REGEX').")
@click.option("--model", "model_only", is_flag=True,
              help="Model weights only, named by their model FQN (compares a DCP checkpoint with its HF export).")
@click.option("--map", "key_map", default=None,
              help="Compare as export-hf --map NAME|FILE would name the weights (torchtitan-llama, identity, a map "
                   "file): the non-HF side is renamed and q/k rows permuted; implies --model.")
@click.option("--config", default=None,
              help="config.json (path or inline JSON) with the head counts for --map (default: a config.json of A or B).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (schemas/diff.schema.json).")
@click.option("--workers", type=int, default=None, help="Comparing threads (default: CPU count, 2..8).")
@click.option("--trust-pickle", is_flag=True, help="Load non-tensor entries that need arbitrary classes to compare values.")
@click.option("--no-verify-source", "no_verify", is_flag=True,
              help="Do not check each chunk's stored checksum (DCP CRC-32, store xxh3) while reading; compare anyway.")
def diff_cmd(a: str, b: str, atol: float, rtol: float, key_pattern: str | None, model_only: bool,
             key_map: str | None, config: str | None, as_json: bool, workers: int | None, trust_pickle: bool,
             no_verify: bool) -> None:
    """Compare checkpoints A and B of any formats, streaming.

    Keys on one side only, dtype/shape mismatches, and per tensor: bitwise equal, or how many
    elements differ with the max abs/rel difference. Exit status 0 when they match, 1 when not.
    """
    from converter.api import diff
    from converter.tools.diff import render_text

    report = diff(a, b, atol=atol, rtol=rtol, key_pattern=key_pattern, model_only=model_only,
                  trust_pickle=trust_pickle, workers=_workers(workers), key_map=key_map, config=config,
                  verify_source=not no_verify)
    _finish(report, render_text, as_json, report.same)


def _finish(report: Any, render_text: Callable[[Any], str], as_json: bool, good: bool) -> None:
    """Print a tool's report (JSON or text); exit status 1 when it found something."""
    if as_json:
        echo_doc(report.to_json())
    else:
        click.echo(render_text(report))
    if not good:
        sys.exit(EXIT_FOUND)


def _workers(workers: int | None) -> int | None:
    from formats.errors import ConfigError

    if workers is not None and workers < 1:
        raise ConfigError(f"--workers must be at least 1 (got {workers})")
    return workers


@click.command("files")
@click.argument("path", type=click.Path())
@click.option("--rank", type=int, default=None, help="The target rank whose files to list.")
@click.option("--node", type=int, default=None, help="The node whose files to list (its ranks N*K .. N*K+K-1).")
@click.option("--ranks-per-node", type=int, default=None, metavar="K",
              help="With --node: ranks per node (default: the output's own --ranks-per-node).")
@click.option("--relative", is_flag=True, help="Print names relative to PATH (e.g. for rsync --files-from).")
def files_cmd(path: str, rank: int | None, node: int | None, ranks_per_node: int | None, relative: bool) -> None:
    """Print, one per line, exactly the files the target rank's (or node's) dcp.load opens in PATH,
    a from-universal output: what a launcher stages to that rank's local disk."""
    import os

    from formats.errors import ConfigError
    from converter.tools.files import node_files, rank_files

    if (rank is None) == (node is None):
        raise ConfigError("give exactly one of --rank R or --node N")
    if ranks_per_node is not None and node is None:
        raise ConfigError("--ranks-per-node goes with --node N")
    names = rank_files(path, rank) if rank is not None else node_files(path, node, ranks_per_node)
    for name in names:
        click.echo(name if relative else os.path.join(path, name))


def register(cli: click.Group) -> None:
    """Add ``verify``, ``diff`` and ``files`` to the ``ckptconv`` group."""
    cli.add_command(verify_cmd)
    cli.add_command(diff_cmd)
    cli.add_command(files_cmd)
