"""``--map torchtitan:MODEL[/FLAVOR]``: torchtitan's own ``state_dict_adapter`` run on probes.

Runs only inside ``python -m converter.plan.titan_adapter`` (the converter side is
:mod:`converter.plan.adapter_maps`): it imports torch and torchtitan, builds the model's config
(and, to pick a flavor, the model on the meta device), and calls the adapter's ``to_hf`` or
``from_hf`` on a state dict of *probes*: meta tensors of the checkpoint's shapes and dtypes that
carry an index expression (:mod:`converter.plan.index_expr`) instead of data. Every torch op the
adapter applies to a probe (view, reshape, transpose, split, chunk, cat, stack, slicing, clone,
...) is applied to its expression, so each output tensor comes back as the exact description of
which source elements it holds: names, permutations, splits, concatenations and stacks, with no
tensor data anywhere. An op that computes on values is refused, naming it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from converter.plan import index_expr as ix
from formats.errors import ConfigError, UnsupportedError

#: Tensor methods and properties that only read metadata: answered by the meta tensor.
_METADATA = frozenset({
    "shape", "size", "dim", "ndim", "ndimension", "numel", "nelement", "dtype", "device", "__len__", "is_floating_point",
    "element_size", "layout", "is_contiguous", "requires_grad", "is_meta", "is_cuda", "is_cpu", "names",
    "is_complex", "is_sparse", "__hash__", "__bool__", "storage_offset", "stride", "get_device", "data_ptr",
    "untyped_storage", "__format__", "__repr__", "__str__", "_is_view", "is_leaf", "grad", "is_quantized",
    "__reduce_ex__", "__deepcopy__", "__contains__", "__iter__",
})
_IDENTITY = frozenset({"contiguous", "clone", "detach", "detach_", "requires_grad_", "cpu", "__deepcopy__"})
_CASTS = {"float": "float32", "double": "float64", "half": "float16", "bfloat16": "bfloat16"}


def _probe_class():
    import torch

    class Probe(torch.Tensor):
        """A meta tensor carrying an index expression (``expr``)."""

        expr: Any

        @staticmethod
        def __new__(cls, expr: Any, dtype: Any):
            meta = torch.empty(expr.shape, dtype=dtype, device="meta")
            r = torch.Tensor._make_subclass(cls, meta)
            r.expr = expr
            return r

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return _dispatch(Probe, func, args, kwargs or {})

    return Probe


def _name(func: Any) -> str:
    import torch

    full = torch.overrides.resolve_name(func) or getattr(func, "__name__", repr(func))
    parts = full.split(".")
    return parts[-2] if parts[-1] == "__get__" else parts[-1]


def _meta(x: Any) -> Any:
    import torch

    if isinstance(x, torch.Tensor) and hasattr(x, "expr"):
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.as_subclass(x, torch.Tensor)
    if isinstance(x, (list, tuple)):
        return type(x)(_meta(v) for v in x)
    return x


def _dispatch(Probe: type, func: Any, args: tuple, kwargs: dict) -> Any:
    import torch

    name = _name(func)
    with torch._C.DisableTorchFunctionSubclass():
        if name in _METADATA:
            return func(*_meta(args), **_meta(kwargs))
        try:
            result = func(*_meta(args), **_meta(kwargs))  # shapes (and that the op is valid)
        except Exception as e:  # noqa: BLE001 - the adapter's own op failed on these shapes
            raise ConfigError(f"torchtitan's adapter failed on the checkpoint's shapes ({name}: {e}); "
                              "pick the flavor the checkpoint was trained with") from None
    exprs = _apply(name, args, kwargs, result)
    return _wrap(Probe, exprs, result)


def _wrap(Probe: type, exprs: Any, result: Any) -> Any:
    if isinstance(exprs, (list, tuple)):
        return type(result)(_wrap(Probe, e, r) for e, r in zip(exprs, result))
    if tuple(exprs.shape) != tuple(result.shape):
        raise UnsupportedError(f"internal error: probe shape {list(exprs.shape)} != torch's {list(result.shape)}")
    return Probe(exprs, result.dtype)


def _expr(x: Any) -> Any:
    e = getattr(x, "expr", None)
    if e is None:
        raise UnsupportedError("the adapter mixes a checkpoint tensor with a tensor of its own; ckptconv maps only "
                               "rearrangements of the checkpoint's tensors")
    return e


def _dims(args: Sequence[Any]) -> list[int]:
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        return [int(a) for a in args[0]]
    return [int(a) for a in args]


def _apply(name: str, args: tuple, kwargs: dict, result: Any) -> Any:
    """The expression(s) of ``name(*args, **kwargs)`` (``result``: torch's meta answer)."""
    if name in _IDENTITY:
        return _expr(args[0])
    if name in _CASTS or name == "to" or name == "type":
        return _expr(args[0])  # a cast: the same elements (the dtype travels with the result)
    if name in ("view", "reshape", "view_as", "reshape_as", "flatten", "unflatten", "_unsafe_view"):
        return ix.reshape(_expr(args[0]), list(result.shape))
    if name in ("transpose", "swapaxes", "swapdims"):
        return ix.transpose(_expr(args[0]), int(_arg(args, kwargs, 1, "dim0")), int(_arg(args, kwargs, 2, "dim1")))
    if name in ("t", "T", "mT"):
        e = _expr(args[0])
        n = len(e.shape)
        return e if n < 2 else ix.transpose(e, n - 2, n - 1)
    if name == "permute":
        return ix.permute(_expr(args[0]), _dims(args[1:]) if len(args) > 1 else list(kwargs["dims"]))
    if name == "movedim":
        e = _expr(args[0])
        src, dst = int(_arg(args, kwargs, 1, "source")), int(_arg(args, kwargs, 2, "destination"))
        order = [d for d in range(len(e.shape)) if d != src % len(e.shape)]
        order.insert(dst % len(e.shape), src % len(e.shape))
        return ix.permute(e, order)
    if name == "narrow":
        return ix.narrow(_expr(args[0]), int(args[1]), int(args[2]), int(args[3]))
    if name == "select":
        e = _expr(args[0])
        d = int(_arg(args, kwargs, 1, "dim"))
        i = int(_arg(args, kwargs, 2, "index")) % e.shape[d]
        return ix.squeeze(ix.narrow(e, d, i, 1), d)
    if name in ("split", "chunk", "tensor_split", "split_with_sizes", "unbind"):
        return _pieces(name, args, kwargs, result)
    if name in ("squeeze", "unsqueeze"):
        return _squeeze(name, _expr(args[0]), args[1:], kwargs, result)
    if name in ("cat", "concat", "concatenate", "stack"):
        parts = [_expr(t) for t in args[0]]
        dim = int(_arg(args, kwargs, 1, "dim", 0))
        return ix.stack(parts, dim) if name == "stack" else ix.cat(parts, dim)
    if name == "__getitem__":
        return _getitem(_expr(args[0]), args[1])
    raise UnsupportedError(f"torchtitan's adapter applies {name!r} to a checkpoint tensor; ckptconv maps only "
                           "rearrangements (view, reshape, transpose, split, cat, stack, slicing)")


def _arg(args: tuple, kwargs: dict, i: int, key: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(key, default)


def _pieces(name: str, args: tuple, kwargs: dict, result: Sequence[Any]) -> list[Any]:
    e = _expr(args[0])
    dim = int(_arg(args, kwargs, 2 if name != "unbind" else 1, "dim", 0)) % len(e.shape)
    if name == "unbind":
        return [ix.squeeze(ix.narrow(e, dim, i, 1), dim) for i in range(e.shape[dim])]
    out, at = [], 0
    for r in result:
        n = r.shape[dim]
        out.append(ix.narrow(e, dim, at, n))
        at += n
    return out


def _squeeze(name: str, e: Any, rest: tuple, kwargs: dict, result: Any) -> Any:
    dims = rest[0] if rest else kwargs.get("dim")
    if name == "unsqueeze":
        return ix.unsqueeze(e, int(dims))
    if dims is None:
        dims = [d for d, n in enumerate(e.shape) if n == 1]
    for d in sorted([int(x) % len(e.shape) for x in (dims if isinstance(dims, (list, tuple)) else [dims])], reverse=True):
        e = ix.squeeze(e, d)
    return e


def _getitem(e: Any, index: Any) -> Any:
    items = list(index) if isinstance(index, tuple) else [index]
    if any(i is Ellipsis for i in items):
        at = items.index(Ellipsis)
        fill = len(e.shape) - sum(1 for i in items if i is not None and i is not Ellipsis)
        items[at: at + 1] = [slice(None)] * fill
    d = 0
    for item in items:
        if item is None:
            e = ix.unsqueeze(e, d)
            d += 1
        elif isinstance(item, slice):
            start, stop, step = item.indices(e.shape[d])
            if step != 1:
                raise UnsupportedError("torchtitan's adapter slices with a step; ckptconv cannot stream that")
            e = ix.narrow(e, d, start, max(0, stop - start))
            d += 1
        elif isinstance(item, int):
            e = ix.squeeze(ix.narrow(e, d, item % e.shape[d], 1), d)
        else:
            raise UnsupportedError(f"torchtitan's adapter indexes with {type(item).__name__}; ckptconv cannot stream that")
    return e


# ---------------------------------------------------------------------------------------------
# the model and its adapter


def _registry(model: str):
    import importlib

    try:
        pkg = importlib.import_module(f"torchtitan.models.{model}")
    except ImportError as e:
        raise ConfigError(f"--map torchtitan:{model}: torchtitan has no model {model!r} here ({e})") from None
    registry = getattr(pkg, "model_registry", None)
    configs = next((getattr(pkg, n) for n in dir(pkg) if n.endswith("_configs") and isinstance(getattr(pkg, n), dict)), {})
    if registry is None:
        raise ConfigError(f"--map torchtitan:{model}: torchtitan.models.{model} has no model_registry")
    return registry, list(configs)


def _meta_state(spec: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    import torch

    with torch.device("meta"):
        module = spec.model.build()
    return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in module.state_dict().items()
            if hasattr(v, "shape")}


def _pick_spec(target: str, tensors: Mapping[str, Any], direction: str):
    """The model spec of ``MODEL/FLAVOR``, or of the MODEL flavor the tensors fit (debug flavors
    first; the first whose state dict holds every native tensor with its shape, or whose
    ``to_hf`` names and shapes hold every HF tensor)."""
    model, _, flavor = target.partition("/")
    registry, flavors = _registry(model)
    if flavor:
        try:
            return registry(flavor)
        except KeyError:
            raise ConfigError(f"--map torchtitan:{target}: no flavor {flavor!r}; known: {', '.join(sorted(flavors))}") from None
    order = sorted(flavors, key=lambda f: (0 if "debug" in f.lower() else 1, f))
    want = {k: tuple(v[0]) for k, v in tensors.items()}
    for f in order:
        try:
            spec = registry(f)
            state = _meta_state(spec)
        except Exception:  # noqa: BLE001 - a flavor that does not build here is not the one
            continue
        have = {k: s for k, (s, _) in state.items()}
        if direction == "from_hf":
            adapter = spec.state_dict_adapter(spec.model, None)
            hf = run_adapter(adapter, "to_hf", {k: (s, d) for k, (s, d) in state.items()})[0]
            have = {k: tuple(v["shape"]) for k, v in hf.items()}
        if all(have.get(k) == s for k, s in want.items()):
            return spec
    raise ConfigError(f"--map torchtitan:{model}: no flavor of {model} ({', '.join(order)}) has the checkpoint's "
                      f"tensors and shapes; name it: torchtitan:{model}/FLAVOR")


def run_adapter(adapter: Any, direction: str, tensors: Mapping[str, tuple[Sequence[int], str]]) -> tuple[dict, list[str]]:
    """(output name -> {"shape", "dtype", "expr"}, the input names no output reads) of the
    adapter's ``direction`` (``to_hf`` / ``from_hf``) on probes of ``tensors``."""
    import torch

    Probe = _probe_class()
    probes = {k: Probe(ix.leaf(k, s), getattr(torch, d)) for k, (s, d) in tensors.items()}
    out = getattr(adapter, direction)(dict(probes))
    docs, used = {}, set()
    for name, value in out.items():
        e = _expr(value)
        used.update(ix.sources_of(e))
        docs[name] = {"shape": list(e.shape), "dtype": str(value.dtype).removeprefix("torch."), "expr": ix.to_json(e)}
    return docs, [k for k in tensors if k not in used]


def adapter_doc(target: str, direction: str, tensors: Mapping[str, Any]) -> dict:
    """What the subprocess answers: the adapter's outputs on probes of ``tensors`` (JSON-able)."""
    if direction not in ("to_hf", "from_hf"):
        raise ConfigError(f"internal error: adapter direction {direction!r}")
    from converter.plan.torchtitan import _prepare_imports

    _prepare_imports()
    spec = _pick_spec(target, tensors, direction)
    if spec.state_dict_adapter is None:
        raise ConfigError(f"--map torchtitan:{target}: torchtitan's {spec.name} has no state_dict_adapter")
    adapter = spec.state_dict_adapter(spec.model, None)
    docs, unused = run_adapter(adapter, direction, {k: (v[0], v[1]) for k, v in tensors.items()})
    return {"name": f"torchtitan:{spec.name}/{spec.flavor}", "adapter": type(adapter).__name__,
            "tensors": docs, "unused": unused}


def main(argv: Sequence[str]) -> int:
    """``python -m converter.plan.titan_adapter MODEL[/FLAVOR] DIRECTION`` with ``{name: [shape,
    dtype]}`` on stdin: print the answer as one JSON line."""
    from converter.plan.from_code import answer

    target, direction = argv
    return answer(lambda: adapter_doc(target, direction, json.loads(sys.stdin.read())))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
