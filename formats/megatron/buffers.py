"""Where each parameter lies in megatron-core's DistributedOptimizer buffers (pure; megatron-core 0.19.2).

megatron's DDP keeps one contiguous buffer per model chunk and buffer group (parameter dtype,
gradient dtype, expert-parallel or not: ``group_params_for_buffers``), parameters in REVERSE order
of ``named_parameters()``, each starting on a 64-element boundary (``pad_param_start``), cut into
buckets: a new bucket after a parameter that fills ``bucket_size`` elements, and around a
``shared_embedding`` parameter (a tied embedding / output layer on a pipeline with more than one
stage) which gets a bucket of its own (``DistributedOptimizer._compute_per_buffer_param_layout``).
Bucket ends are padded for DP divisibility.

Both flat optimizer formats drop that end padding: ``distrib_optim.pt``
(``get_parameter_state_dp_zero``: per buffer, ``param`` / ``exp_avg`` / ``exp_avg_sq`` tensors of
``numel_unpadded`` fp32 elements, the buckets one after the other) and torch_dist's
``dp_reshardable`` state (per bucket). :func:`buffer_layout` gives each parameter's range there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Parameter starts are aligned to this many elements (``pad_param_start``).
PARAM_ALIGN = 64


@dataclass(frozen=True)
class BufferParam:
    """One parameter of a buffer: its name, element count, bucket and range in the unpadded buffer."""

    name: str
    numel: int
    bucket: int
    start: int  # in the buffer with bucket-end padding removed
    end: int


@dataclass(frozen=True)
class BufferLayout:
    """A buffer's parameters (buffer order) and its buckets' unpadded sizes."""

    params: tuple[BufferParam, ...]
    bucket_numels: tuple[int, ...]

    @property
    def numel_unpadded(self) -> int:
        return sum(self.bucket_numels)


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def buffer_layout(params: Sequence[tuple[str, int, bool]], bucket_size: int | None) -> BufferLayout:
    """The layout of one buffer holding ``params`` = ``(name, numel, shared_embedding)`` in
    ``named_parameters()`` order (see the module docstring); ``bucket_size`` None: one bucket
    (but for shared embeddings)."""
    placed: list[BufferParam] = []
    bucket_numels: list[int] = []
    start, offset, in_bucket = 0, 0, 0  # start: relative to the current bucket; offset: where it starts

    def finish(end: int) -> None:  # the bucket's unpadded size is up to ``end`` (a bucket-relative index)
        nonlocal start, offset, in_bucket
        bucket_numels.append(end)
        offset, start, in_bucket = offset + end, 0, 0

    for name, numel, shared in reversed(list(params)):
        start = _pad(start, PARAM_ALIGN)
        if shared and in_bucket:
            finish(start)
        end = start + numel
        placed.append(BufferParam(name, numel, len(bucket_numels), offset + start, offset + end))
        in_bucket += 1
        if (bucket_size is not None and end >= bucket_size) or shared:
            finish(end)
        else:
            start = end
    if in_bucket:
        finish(start)
    return BufferLayout(tuple(placed), tuple(bucket_numels))


def ddp_bucket_size(overlap_grad_reduce: bool, bucket_size: int | None, dp_size: int, pp_rank: int,
                    chunk: int) -> int | None:
    """megatron's bucket size for model chunk ``chunk`` on pipeline rank ``pp_rank`` (Megatron-LM's
    ``get_model``/DDP): None (one bucket) without ``--overlap-grad-reduce``, off pipeline stage 0 and
    for every model chunk after the first; else ``--ddp-bucket-size`` or ``max(40M, 1M x DP)``."""
    if not overlap_grad_reduce or pp_rank > 0 or chunk > 0:
        return None
    return bucket_size if bucket_size is not None else max(40_000_000, 1_000_000 * dp_size)
