"""The one conversion pipeline every command runs, and its result."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConversionResult:
    """What a conversion wrote."""

    dst: str
    tensors: int
    objects: int
    bytes: int
    seconds: float
    plan: str | None = None
    warnings: tuple[str, ...] = ()
    preview: dict | None = None  # from-universal --dry-run: the target plan (schemas/target-plan.schema.json)
    mesh: str | None = None  # from-universal: the target mesh
    world_size: int | None = None  # from-universal: ranks of the target job
