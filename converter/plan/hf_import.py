"""What import-hf writes, decided from the HF index alone (pure): the universal key, object path
and source (with any row permutation) of every tensor, tied weights recreated, per-expert HF
tensors stacked into one grouped tensor."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from converter.plan.adapter_maps import AdapterMap, source_of, unused_note
from converter.plan.key_maps import KeyMap, rename_all
from converter.plan.mapped_view import Source, row_permutation
from formats.base import CheckpointIndex
from formats.errors import InvalidCheckpointError

#: HF name of a tied output projection -> the HF name of the embedding it is tied to. Hugging Face
#: saves a tied ``lm_head.weight`` only once, as the embedding (safetensors refuses shared storage).
TIED_HF = {"lm_head.weight": "model.embed_tokens.weight"}


def tied_copies(index: CheckpointIndex, config: Mapping[str, Any] | None) -> dict[str, str]:
    """HF names the checkpoint left out because ``config.json`` says ``tie_word_embeddings`` ->
    the HF name whose tensor they are (pure); empty when not tied or already present."""
    if not config or config.get("tie_word_embeddings") is not True:
        return {}
    return {out: emb for out, emb in TIED_HF.items() if out not in index.tensors and emb in index.tensors}


def plan_import(index: CheckpointIndex, kmap: KeyMap, config: Mapping[str, Any] | None,
                prefix: str | None) -> tuple[dict[str, Source], dict[str, tuple]]:
    """Pure: (universal key -> Source, universal key -> object path) for an HF index.

    A tied output projection the checkpoint omits (see :func:`tied_copies`) is recreated from
    the embedding it is tied to, so that the model's state dict (which holds both) loads.
    """
    if isinstance(kmap, AdapterMap):
        return _plan_adapter_import(index, kmap, prefix)
    tied = tied_copies(index, config)
    experts = _expert_stacks(index, kmap)
    in_stack = {k for keys in experts.values() for k in keys}
    names = rename_all([k for k in [*index.tensors, *tied] if k not in in_stack], kmap.importer(), kmap.name, "import")
    sources, paths = {}, {}
    for native, keys in experts.items():
        key = f"{prefix}.{native}" if prefix else native
        sources[key] = Source("", stack=keys)
        paths[key] = (prefix, native) if prefix else (native,)
    for hf, native in names.items():
        key = f"{prefix}.{native}" if prefix else native
        src = tied.get(hf, hf)
        sources[key] = Source(src, row_permutation(kmap, native, index.tensors[src].shape, config, to_hf=False))
        paths[key] = (prefix, native) if prefix else (native,)
    return sources, paths


def _plan_adapter_import(index: CheckpointIndex, kmap: AdapterMap,
                         prefix: str | None) -> tuple[dict[str, Source], dict[str, tuple]]:
    """The import torchtitan's own adapter gives (``from_hf`` on probes of the HF tensors)."""
    tensors = {k: (tuple(e.shape), e.dtype) for k, e in index.tensors.items()}
    result = kmap.imported(tensors)
    shapes = {k: s for k, (s, _) in tensors.items()}
    sources, paths = {}, {}
    for native, (expr, _, _) in result.tensors.items():
        key = f"{prefix}.{native}" if prefix else native
        sources[key] = source_of(expr, shapes)
        paths[key] = (prefix, native) if prefix else (native,)
    return sources, paths


def adapter_notes(index: CheckpointIndex, kmap: KeyMap | AdapterMap) -> tuple[str, ...]:
    """The warning an adapter import prints for the HF tensors it drops (cached answer)."""
    if not isinstance(kmap, AdapterMap):
        return ()
    return unused_note(kmap.imported({k: (tuple(e.shape), e.dtype) for k, e in index.tensors.items()}), "from_hf",
                       "HF tensor")


def _expert_stacks(index: CheckpointIndex, kmap: KeyMap) -> dict[str, tuple[str, ...]]:
    """Grouped native name -> its HF expert tensors in expert order ``0..E-1`` (pure); a missing
    expert is an InvalidCheckpointError naming it."""
    found: dict[str, dict[int, str]] = {}
    for hf in index.tensors:
        hit = kmap.expert_of(hf)
        if hit is not None:
            found.setdefault(hit[0], {})[hit[1]] = hf
    out = {}
    for native, by_expert in found.items():
        missing = sorted(set(range(max(by_expert) + 1)) - set(by_expert))
        if missing:
            raise InvalidCheckpointError(
                f"{index.root}: expert {missing[0]} of {native} is missing ({len(by_expert)} of {max(by_expert) + 1} "
                "experts present); the HF checkpoint must hold every expert 0..E-1")
        out[native] = tuple(by_expert[e] for e in range(len(by_expert)))
    return out


def tied_notes(index: CheckpointIndex, config: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The warnings an import prints for each tied weight it recreates."""
    return tuple(f"{out} recreated from {emb}: config.json says tie_word_embeddings and the checkpoint "
                 "stores the tied weight once" for out, emb in tied_copies(index, config).items())
