"""consolidate: a checkpoint -> the hub-shaped files torch's ``consolidate_safetensors_files`` makes.

What ``HuggingFaceStorageWriter(enable_consolidation=True)`` (and torchtitan's
``last_save_in_hf``) does after a save, done on its own: every tensor whole, in
``model-<F>-of-<N>.safetensors`` with torch's header and ``model.safetensors.index.json``, byte
for byte torch's, keys as saved (no renaming; non-tensor entries left out). The source is usually
DCP's per-rank safetensors (``sharded/``), but any checkpoint ckptconv reads will do. Unlike
torch's (which assembles each tensor in memory on one rank and crashes on integer and bool
tensors), every tensor is one write task streamed from the source's chunks under the memory
budget, split across workers and torchrun ranks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from converter.config import RunOptions, parse_size
from converter.plan.copy_tasks import describe, total_target_nbytes
from converter.plan.dcp_safetensors import consolidation_tasks, load_fqn_index, plan_hub, tensors_only_warning
from converter.run.destination import option_value
from converter.run.pipeline import (Conversion, ConversionResult, Output, PlannedOutput, conversion_command,
                                     run_conversion)
from converter.run.sinks import dcp_safetensors_output
from converter.run.sources import open_checkpoint
from formats.dcp_safetensors import CONSOLIDATED
from formats.errors import ConfigError
from formats.hf import SafetensorsFilesWriter


@conversion_command("consolidate")
def consolidate(src: str | os.PathLike, dst: str | os.PathLike, *, max_shard_size: int | str | None = None,
                fqn_index: str | os.PathLike | Mapping[str, int] | None = None,
                options: RunOptions | None = None) -> ConversionResult:
    """Write the hub-shaped safetensors files of ``src`` into ``dst``, as torch's consolidation.

    ``max_shard_size`` (bytes or ``5GB``) splits the keys as huggingface_hub splits shards (default:
    one file, torch's default); ``fqn_index`` is torch's ``fqn_to_index_mapping`` itself (a hub
    ``model.safetensors.index.json``, its folder, or ``{key: index}``; it also orders the files).
    Keys come in the order ``dcp.save``'s metadata lists them (rank by rank, each in state-dict
    order), which is the order torch's writer consolidates in.
    """
    options = options or RunOptions()
    max_bytes = None if max_shard_size is None else parse_size(max_shard_size)
    if max_bytes is not None and max_bytes < 1:
        raise ConfigError(f"--max-shard-size must be positive (got {max_shard_size!r})")
    if max_bytes is not None and fqn_index is not None:
        raise ConfigError("--fqn-index is the split itself: pass it or --max-shard-size, not both")
    mapping = None if fqn_index is None else load_fqn_index(fqn_index)
    reader = open_checkpoint(src, trust_pickle=options.trust_pickle, verify=options.verify_source)
    try:
        index = reader.index()
        layout = plan_hub(index, max_bytes, mapping)
        tasks = consolidation_tasks(index, layout, options.effective_piece_bytes)
        nbytes = total_target_nbytes(tasks)
        warnings = tuple(tensors_only_warning(list(index.objects)))

        def open_output(out: Path) -> Output:
            writer = SafetensorsFilesWriter(out, layout.consolidated, layout.index)
            return dcp_safetensors_output(None, layout, writer, nbytes)

        def text() -> str:
            files = "\n".join(f"{p.name}  {len(p.tensors)} tensors  {p.size} bytes" for p in layout.consolidated)
            return f"{files}\n{layout.index[0]}\n{describe(tasks)}"

        header = {"--max-shard-size": max_bytes, "--fqn-index": option_value(fqn_index)}
        planned = ConversionResult(str(dst), len(index.tensors), 0, nbytes, 0.0, warnings=warnings)
        expected = PlannedOutput.of((k + CONSOLIDATED, e.dtype, e.shape) for k, e in index.tensors.items())
        return run_conversion(Conversion("consolidate", src, dst, index, reader, tasks, header, open_output, planned,
                                         describe=lambda: (text(), None), dry_run_warnings=warnings,
                                         expected=expected), options)
    finally:
        reader.close()
