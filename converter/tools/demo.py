"""``ckptconv demo``: the whole pipeline on the bundled demo checkpoint, checked by torch itself."""

from __future__ import annotations

import tempfile
import warnings
from importlib import resources
from pathlib import Path

import click
import torch

from formats.errors import CkptConvError


def demo_checkpoint() -> Path:
    """The bundled demo: a tiny Llama trained 3 steps under FSDP2 on 2 ranks (DCP, AdamW state)."""
    path = Path(str(resources.files("converter").joinpath("demo_data")))
    if not (path / ".metadata").is_file():
        raise CkptConvError(f"{path}: the bundled demo checkpoint is missing; regenerate it with python bench/make_demo.py")
    return path


def load_with_torch(path: Path, index) -> dict:
    """Every tensor and object of a DCP checkpoint, loaded by torch's own ``dcp.load`` (oracle)."""
    import torch.distributed.checkpoint as dcp

    from formats.dtypes import by_name

    flat = {k: torch.zeros(e.shape, dtype=by_name(e.dtype).torch_dtype) for k, e in index.tensors.items()}
    flat |= {k: None for k in index.objects}
    with warnings.catch_warnings():  # a single-process load is what we mean: not worth a warning
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(flat, checkpoint_id=str(path), planner=dcp.DefaultLoadPlanner(flatten_state_dict=False))
    return flat


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    return a == b


def _step(console, title: str) -> None:
    """A step heading, whole (paths are never cut to fit the width)."""
    from rich.text import Text

    console.print(Text(f"== {title}", style="bold"), soft_wrap=True)


def run_demo(workdir: str | None = None) -> None:
    """inspect -> to-universal -> from-universal (two meshes) -> reload with torch and compare."""
    from rich.console import Console

    from converter.commands.from_universal import from_universal
    from converter.commands.to_universal import to_universal
    from converter.config import RunOptions
    from converter.run.sources import open_checkpoint
    from converter.tools.inspect import build_report, render_layout, render_report
    from converter.units import human_bytes

    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="ckptconv-demo-"))
    src = demo_checkpoint()
    console = Console()
    reader = open_checkpoint(src)
    index = reader.index()
    _step(console, f"1. ckptconv inspect {src}")
    render_report(build_report(reader), console)
    render_layout(index, "model.tok_embeddings.weight", console, height=8)
    options = RunOptions(workers=2, overwrite=True, progress=False)
    uni = work / "uni"
    _step(console, f"2. ckptconv to-universal -> {uni}")
    r = to_universal(src, uni, options)
    console.print(f"{r.tensors} tensors, {r.objects} objects, {human_bytes(r.bytes)} in {r.seconds:.3f}s")
    reference = load_with_torch(src, index)
    for mesh, plan in (("dp3", "fsdp"), ("tp2,dp2", "llama")):
        out = work / f"out-{mesh.replace(',', '-')}"
        _step(console, f"3. ckptconv from-universal --mesh {mesh} --plan {plan} -> {out}")
        r = from_universal(uni, out, mesh, plan=plan, options=options)
        for w in r.warnings:
            console.print(f"warning: {w}")
        out_index = open_checkpoint(out).index()
        render_layout(out_index, "model.layers.0.attention.wq.weight", console, height=8)
        loaded = load_with_torch(out, out_index)
        bad = [k for k in reference if not _same(reference[k], loaded[k])]
        if bad:
            raise CkptConvError(f"demo: {len(bad)} entries differ after conversion to {mesh}, e.g. {bad[0]!r}")
        console.print(f"[green]torch's dcp.load of {out.name}: all {len(reference)} entries bit-identical to the source[/green]")
    click.echo(f"demo outputs in {work}")
