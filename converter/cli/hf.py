"""``ckptconv export-hf``, ``ckptconv import-hf`` and ``ckptconv consolidate`` (registered on the
main group by :func:`register`; they call :func:`converter.api.export_hf` /
:func:`converter.api.import_hf` / :func:`converter.api.consolidate`)."""

from __future__ import annotations

from typing import Any

import click

from converter.cli.common import MAP_HELP, SIZE, make_options, report_result, run_options


@click.command("export-hf")
@click.argument("src", type=click.Path())
@click.argument("out", type=click.Path())
@click.option("--map", "key_map", default="identity", show_default=True, help=MAP_HELP)
@click.option("--max-shard-size", type=SIZE, default=None,
              help="Largest shard file (default 5GB; huggingface_hub's rule: greedy in key order; bigger tensors alone).")
@click.option("--dtype", default=None, help="Cast floating-point weights: bf16, fp16, fp32, fp64 (or bfloat16, float16, ...); float8/int kept.")
@click.option("--config", default=None,
              help="config.json to write into OUT: a path or inline JSON; the Llama map completes it from the "
                   "weights and reads its head counts.")
@click.option("--quantize", type=click.Choice(["fp8-block"]), default=None,
              help="Write the linear weights as block-scaled FP8 (e4m3 + float32 weight_scale_inv per block, "
                   "DeepSeek-V3's hub form; block from --config's quantization_config.weight_block_size, "
                   "default 128x128). Weights already FP8 with their scales are written as they are.")
@click.option("--like", "like", type=click.Path(), default=None, metavar="BASE_HF_DIR",
              help="Lay the export out as this base model directory: its shard files (names, which tensor in which), "
                   "each tensor's dtype, FP8 where it has it, and its non-weight files (config, generation config, "
                   "tokenizer, ...); a tensor the base lacks or has and the checkpoint lacks is an error.")
@click.option("--all-steps", is_flag=True, default=False,
              help="SRC is a run directory: export every step folder in it (a checkpoint each) to OUT/<step>; "
                   "steps already converted are skipped, interrupted ones resumed, each is checked. A quoted glob "
                   "SRC ('run/step-*') does the same for the folders it matches.")
@run_options
def export_hf_cmd(src: str, out: str, key_map: str, max_shard_size: int | None, dtype: str | None,
                  config: str | None, quantize: str | None, like: str | None, all_steps: bool, **kw: Any) -> None:
    """Write the model weights of SRC (universal store or DCP) as Hugging Face safetensors in OUT."""
    from converter.api import export_hf

    report_result(export_hf(src, out, key_map=key_map, max_shard_size=max_shard_size, dtype=dtype, config=config,
                      options=make_options(**kw), quantize=quantize, like=like, all_steps=all_steps))


@click.command("import-hf")
@click.argument("hf_dir", type=click.Path())
@click.argument("uni", type=click.Path())
@click.option("--map", "key_map", default="identity", show_default=True, help=MAP_HELP)
@click.option("--config", default=None, help="config.json with the head counts (default: HF_DIR/config.json).")
@click.option("--prefix", default=None, help="Put the weights under this state-dict root, e.g. 'model' (default: top level, torchtitan style).")
@click.option("--chunk-size", type=SIZE, default=None, help="Target bytes per chunk (default 64MiB).")
@click.option("--backend", type=click.Choice(["zarr", "safetensors"]), default="zarr", show_default=True,
              help="Where the store keeps tensor bytes: zarr arrays (stock zarr opens them) or safetensors files "
                   "(a file per chunk; safetensors.safe_open opens them).")
@click.option("--dequantize", default=None, metavar="DTYPE",
              help="Dequantize block-scaled FP8 (weight + weight_scale_inv, block from config.json's "
                   "quantization_config.weight_block_size) and MXFP4 (*_blocks + *_scales) tensors into DTYPE "
                   "(bf16, fp16, fp32), exactly as torch's QuantizedHuggingFaceStorageReader / transformers do; "
                   "default: both tensors copied as they are.")
@run_options
def import_hf_cmd(hf_dir: str, uni: str, key_map: str, config: str | None, prefix: str | None,
                  chunk_size: int | None, backend: str, dequantize: str | None, **kw: Any) -> None:
    """Convert Hugging Face safetensors in HF_DIR (single or sharded) into a universal store UNI."""
    from converter.api import import_hf

    report_result(import_hf(hf_dir, uni, key_map=key_map, config=config, prefix=prefix, options=make_options(**kw),
                      chunk_bytes=chunk_size, backend=backend, dequantize=dequantize))


@click.command("consolidate")
@click.argument("src", type=click.Path())
@click.argument("out", type=click.Path())
@click.option("--max-shard-size", type=SIZE, default=None,
              help="Split the keys into files of at most SIZE (huggingface_hub's rule; default one file, torch's default).")
@click.option("--fqn-index", default=None, metavar="FILE",
              help="torch's fqn_to_index_mapping: a hub model.safetensors.index.json (or its folder; each file's number "
                   "is the index, as torchtitan reads it) or JSON {key: index}: the file of every key and the order.")
@run_options
def consolidate_cmd(src: str, out: str, max_shard_size: int | None, fqn_index: str | None, **kw: Any) -> None:
    """Write SRC (DCP's per-rank safetensors, sharded/, or any checkpoint) as the hub-shaped files torch's
    consolidate_safetensors_files writes, byte for byte, streamed."""
    from converter.api import consolidate

    report_result(consolidate(src, out, max_shard_size=max_shard_size, fqn_index=fqn_index,
                              options=make_options(**kw)))


def register(cli: click.Group) -> None:
    """Add the HF commands to the ``ckptconv`` group."""
    cli.add_command(export_hf_cmd)
    cli.add_command(import_hf_cmd)
    cli.add_command(consolidate_cmd)
