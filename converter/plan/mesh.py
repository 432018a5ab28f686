"""The ``--mesh`` grammar: named mesh dims with sizes, and rank <-> coordinate numbering.

``--mesh tp2,dp32`` lists dims by name and size. The order the user writes them in does not matter:
ranks follow torchtitan's canonical order ``pp, dp_replicate, dp_shard, cp, tp`` (outermost first,
``tp`` varies fastest), numbered row-major exactly as ``init_device_mesh(shape, mesh_dim_names)``
numbers them (``mesh = arange(world).view(shape)``). ``--mesh-order`` gives another order.
``dp`` is an alias of ``dp_shard`` (FSDP).

``ep`` (expert parallelism) is torchtitan 0.3.0's ``expert_parallel_degree``: it adds no ranks but
borrows them from ``dp_shard * cp * tp`` (``ParallelDims.build_mesh``): the routed experts live on
the sparse mesh ``(pp, dp_replicate, efsdp, ep)`` unflattened from the same world, ``ep`` the
fastest-varying part of the ``dp_shard, cp, tp`` block and ``efsdp = dp_shard * cp * tp / ep`` the
rest (FSDP of the experts). ``ep`` and ``efsdp`` are therefore not dims of :attr:`Mesh.dims` but
*derived* dims: :meth:`Mesh.size` and :func:`derived_coord` give their sizes and coordinates.
torchtitan 0.3.0 has no expert tensor parallelism (its sparse mesh has no TP dim). ``etp`` is
megatron-core's ``expert_tensor_parallel_size`` (:attr:`Mesh.etp`; it adds no ranks either: megatron
numbers the experts' ranks etp-ep-dp-pp over the same world); only megatron-core's own plan
(``--plan megatron-core``) takes it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from formats.errors import ConfigError, UnsupportedError

#: Mesh dim names in torchtitan's rank order (outermost first).
CANONICAL_ORDER: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
#: Other spellings accepted on the command line.
ALIASES: dict[str, str] = {"dp": "dp_shard"}
#: The dims ``ep`` borrows its ranks from (torchtitan: ``efsdp * ep == dp_shard * cp * tp``).
EP_BLOCK: tuple[str, ...] = ("dp_shard", "cp", "tp")
#: Dims derived from ``ep`` (not in :attr:`Mesh.dims`): torchtitan's sparse-mesh names.
DERIVED: tuple[str, ...] = ("efsdp", "ep")

_TOKEN = re.compile(r"^([a-z_]+?)\s*[=:]?\s*(\d+)$")


@dataclass(frozen=True)
class MeshDim:
    """One named mesh dim and its size."""

    name: str
    size: int


@dataclass(frozen=True)
class Mesh:
    """Named mesh dims in rank order (outermost first; the last dim varies fastest)."""

    dims: tuple[MeshDim, ...]
    #: expert-parallel degree (1: no EP), carved out of the ``dp_shard * cp * tp`` ranks
    ep: int = 1
    #: megatron's expert tensor parallel size (0: not given, megatron's default: the dense tp)
    etp: int = 0

    def __post_init__(self) -> None:
        names = [d.name for d in self.dims]
        if len(set(names)) != len(names):
            raise ConfigError(f"mesh {self}: duplicate dim names; give each dim once")
        bad = [d for d in self.dims if d.size < 1]
        if bad:
            raise ConfigError(f"mesh {self}: dim {bad[0].name} has size {bad[0].size}; sizes must be >= 1")
        if self.ep < 1:
            raise ConfigError(f"mesh {self}: ep must be >= 1")
        if self.etp < 0:
            raise ConfigError(f"mesh {self}: etp must be >= 1")
        block = self.ep_block_size
        if block % self.ep:
            raise ConfigError(
                f"mesh {self}: ep{self.ep} does not divide dp_shard*cp*tp = {block}; torchtitan borrows the ep "
                "ranks from those dims (efsdp = dp_shard*cp*tp/ep): pick an ep that divides it"
            )

    @property
    def ep_block_size(self) -> int:
        """``dp_shard * cp * tp``: the ranks ``ep`` and ``efsdp`` split."""
        return math.prod(self.size(n) for n in EP_BLOCK)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dims)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(d.size for d in self.dims)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def size(self, name: str, default: int = 1) -> int:
        """Size of dim ``name`` (``dp`` means ``dp_shard``; ``ep`` and ``efsdp`` are derived),
        ``default`` when the mesh lacks it."""
        name = ALIASES.get(name, name)
        if name == "ep":
            return self.ep if self.ep > 1 else default
        if name == "efsdp":
            return self.ep_block_size // self.ep if self.ep > 1 else default
        for d in self.dims:
            if d.name == name:
                return d.size
        return default

    def index(self, name: str) -> int:
        """Position of dim ``name`` in rank order (KeyError when absent)."""
        name = ALIASES.get(name, name)
        try:
            return self.names.index(name)
        except ValueError:
            raise KeyError(name) from None

    def coords(self, rank: int) -> tuple[int, ...]:
        """Coordinates of ``rank`` (row-major, as ``init_device_mesh`` numbers ranks)."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside mesh {self} (world size {self.world_size})")
        out = []
        for size in reversed(self.shape):
            rank, c = divmod(rank, size)
            out.append(c)
        return tuple(reversed(out))

    def rank_of(self, coords: tuple[int, ...]) -> int:
        """The rank at ``coords`` (inverse of :meth:`coords`)."""
        if len(coords) != len(self.dims) or any(not 0 <= c < s for c, s in zip(coords, self.shape)):
            raise ConfigError(f"coordinates {tuple(coords)} are outside mesh {self}")
        rank = 0
        for c, size in zip(coords, self.shape):
            rank = rank * size + c
        return rank

    def rank_coords(self, rank: int) -> dict[str, int]:
        """Dim name -> coordinate of ``rank``, the derived ``efsdp`` and ``ep`` included when ep > 1."""
        out = dict(zip(self.names, self.coords(rank)))
        if self.ep > 1:
            out |= {n: derived_coord(self, out, n) for n in DERIVED}
        return out

    def has(self, name: str) -> bool:
        """Whether ``name`` is a dim of this mesh or a derived one (``ep``/``efsdp`` when ep > 1)."""
        return name in self.names or (name in DERIVED and self.ep > 1)

    def __str__(self) -> str:
        return ",".join([f"{d.name}{d.size}" for d in self.dims] + ([f"ep{self.ep}"] if self.ep > 1 else [])
                        + ([f"etp{self.etp}"] if self.etp else []))


def derived_coord(mesh: Mesh, coords: dict[str, int], name: str) -> int:
    """The ``ep`` or ``efsdp`` coordinate of the rank whose mesh coordinates are ``coords``: its
    index in the ``dp_shard, cp, tp`` block (row-major in mesh order) split as ``(efsdp, ep)``,
    as torchtitan's ``_unflatten`` of the world into ``(pp, dp_replicate, efsdp, ep)`` numbers it."""
    flat = 0
    for n in mesh.names:
        if n in EP_BLOCK:
            flat = flat * mesh.size(n) + coords.get(n, 0)
    return flat % mesh.ep if name == "ep" else flat // mesh.ep


def _normalize_name(name: str, text: str) -> str:
    name = ALIASES.get(name, name)
    if name == "efsdp":
        raise UnsupportedError(f"--mesh {text!r}: efsdp cannot be given (efsdp is derived: dp_shard*cp*tp/ep); give "
                               "ep and the dense dims")
    if name not in CANONICAL_ORDER and name not in ("ep", "etp"):
        known = ", ".join(CANONICAL_ORDER + ("ep", "etp") + tuple(ALIASES))
        raise ConfigError(f"--mesh {text!r}: unknown dim name {name!r}; use one of {known}")
    return name


def _parse_token(token: str, text: str) -> MeshDim:
    m = _TOKEN.match(token.strip().lower())
    if not m:
        raise ConfigError(
            f"--mesh {text!r}: cannot read {token.strip()!r}; write a name followed by its size, e.g. tp2,dp32"
        )
    name, size = _normalize_name(m.group(1), text), int(m.group(2))
    if size < 1:
        raise ConfigError(f"--mesh {text!r}: dim {name} has size 0; sizes must be >= 1 (leave the dim out instead)")
    return MeshDim(name, size)


def _parse_order(order: str, names: list[str], text: str) -> list[str]:
    wanted = [_normalize_name(n.strip().lower(), order) for n in order.split(",") if n.strip()]
    if "ep" in wanted or "etp" in wanted:
        raise ConfigError(f"--mesh-order {order!r}: leave ep and etp out; they have no place of their own (they "
                          "number the experts' ranks over the dense ones)")
    if sorted(wanted) != sorted(names) or len(set(wanted)) != len(wanted):
        raise ConfigError(
            f"--mesh-order {order!r} must list each dim of --mesh {text!r} exactly once ({','.join(names)})"
        )
    return wanted


def parse_mesh(text: str, order: str | None = None) -> Mesh:
    """Parse ``--mesh`` (e.g. ``"tp2,dp32"``) into a :class:`Mesh` in rank order.

    Dims are put in torchtitan's canonical order unless ``order`` (``--mesh-order``, names separated
    by commas, outermost first, ``ep`` left out) says otherwise. ``ep`` becomes :attr:`Mesh.ep`.
    Raises ConfigError on unknown names, zero sizes, duplicates and malformed text.
    """
    tokens = [t for t in (text or "").split(",") if t.strip()]
    if not tokens:
        raise ConfigError(f"--mesh {text!r} is empty; give named dims with sizes, e.g. tp2,dp32")
    dims = [_parse_token(t, text) for t in tokens]
    names = [d.name for d in dims]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"--mesh {text!r}: dim {dup[0]} is given twice (dp and dp_shard are the same dim); give it once")
    by_name = {d.name: d for d in dims}
    ep = by_name.pop("ep").size if "ep" in by_name else 1
    etp = by_name.pop("etp").size if "etp" in by_name else 0
    names = [n for n in names if n not in ("ep", "etp")]
    if not names:
        raise ConfigError(f"--mesh {text!r}: ep borrows its ranks from dp_shard, cp and tp; give those too, e.g. dp{ep},ep{ep}")
    ordered = _parse_order(order, names, text) if order else [n for n in CANONICAL_ORDER if n in by_name]
    return Mesh(tuple(by_name[n] for n in ordered), ep, etp)


def refuse_etp(mesh: Mesh, plan: str) -> None:
    """Refuse ``etp`` on a mesh planned by ``plan``, which is not megatron-core's own plan (UnsupportedError)."""
    if mesh.etp:
        raise UnsupportedError(f"--mesh {mesh}: etp (megatron's expert tensor parallel size) is planned only by "
                               f"--plan megatron-core on a Megatron checkpoint with its training args; plan {plan} "
                               "(torchtitan 0.3.0 has no expert tensor parallelism) cannot place it: drop etp")
