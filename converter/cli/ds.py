"""``ckptconv import-ds`` and ``ckptconv export-ds`` (registered on the main group by
:func:`register`; they call :func:`converter.api.import_ds` / :func:`converter.api.export_ds`)."""

from __future__ import annotations

from typing import Any

import click

from converter.cli.common import (SIZE, check_map_json, make_options, map_config_options, map_options, report_mapped,
                                 run_options)


@click.command("import-ds")
@click.argument("ds_dir", type=click.Path())
@click.argument("uni", type=click.Path())
@click.option("--chunk-size", type=SIZE, default=None, help="Target bytes per zarr chunk (default 64MiB).")
@click.option("--backend", type=click.Choice(["zarr", "safetensors"]), default="zarr", show_default=True,
              help="Array format of the store: zarr arrays or safetensors files (README: which to pick).")
@map_config_options
@map_options
@run_options
def import_ds_cmd(ds_dir: str, uni: str, chunk_size: int | None, backend: str, config: str | None, as_json: bool,
                  key_map: str | None, map_direction: str, key_style: str, **kw: Any) -> None:
    """Convert the DeepSpeed universal checkpoint DS_DIR (ds_to_universal.py's output folder, or the
    folder whose latest_universal names it) into a universal store UNI."""
    from converter.api import import_ds

    check_map_json(as_json, kw)
    report_mapped(import_ds(ds_dir, uni, options=make_options(**kw), chunk_bytes=chunk_size, backend=backend,
                            key_map=key_map, map_direction=map_direction, key_style=key_style, config=config), as_json)


@click.command("export-ds")
@click.argument("src", type=click.Path())
@click.argument("out", type=click.Path())
@click.option("--tag", default=None, help="Name of the checkpoint folder in OUT (default global_step<step>).")
@map_config_options
@map_options
@run_options
def export_ds_cmd(src: str, out: str, tag: str | None, config: str | None, as_json: bool, key_map: str | None,
                  map_direction: str, key_style: str, **kw: Any) -> None:
    """Write SRC (universal store or DCP) as a DeepSpeed universal checkpoint in OUT: load it with
    "checkpoint": {"load_universal": true} and engine.load_checkpoint(OUT), under ZeRO-1/2/3."""
    from converter.api import export_ds

    check_map_json(as_json, kw)
    report_mapped(export_ds(src, out, tag=tag, options=make_options(**kw), key_map=key_map, map_direction=map_direction,
                            key_style=key_style, config=config), as_json)


def register(cli: click.Group) -> None:
    """Add the DeepSpeed commands to the ``ckptconv`` group."""
    cli.add_command(import_ds_cmd)
    cli.add_command(export_ds_cmd)
