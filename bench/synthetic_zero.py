"""Synthetic DeepSpeed ZeRO-3 folders at scale for the planning benchmark: the files
``engine.save_checkpoint`` writes for a Llama-3-shaped model on W data-parallel ranks, with the
structure DeepSpeed 0.19.8 pickles (``fp32_flat_groups`` per sub group of at most 1e9 elements,
torch's optimizer state and param groups, ``param_shapes`` in the rank-0 model-states file), and
every tensor storage a hole of its full size (sparse files: no disk, no data).

    python bench/synthetic_zero.py OUT --model 70b --world 1024      # writes OUT/latest, OUT/global_step1/
    python -m converter inspect OUT;  python -m converter from-universal OUT X --mesh dp1024 --dry-run

The zip archives are minimal STORED zip64 archives (zipfile and ckptconv read them; torch.load
would too, but they are not byte-identical to torch.save's); CRCs are zero (never checked by
planning).
"""

from __future__ import annotations

import argparse
import math
import os
import struct
import sys
import time
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from formats.dcp.torch_globals import STORAGE_TYPE_BY_DTYPE, Global, dumps, module_name  # noqa: E402

#: Llama 3 shapes (vocab, dim, layers, ffn, kv dim).
MODELS = {"8b": (128256, 4096, 32, 14336, 1024), "70b": (128256, 8192, 80, 28672, 1024),
          "405b": (128256, 16384, 126, 53248, 1024)}
SUB_GROUP = 10**9  # DeepSpeed's default zero_optimization.sub_group_size

_TORCH = module_name("torch")
_REBUILD = Global(module_name("torch._utils"), "_rebuild_tensor_v2")
_FLOAT = Global(_TORCH, STORAGE_TYPE_BY_DTYPE["float32"])
_ENUM = Global(module_name("deepspeed.runtime.zero.config"), "ZeroStageEnum")


class _Tensor:
    """A contiguous float32 tensor of ``numel`` elements (1-D, or 0-d) in storage ``key``."""

    def __init__(self, key: str, numel: int, zero_d: bool = False) -> None:
        self.key, self.numel, self.zero_d = key, numel, zero_d

    def __reduce_ex__(self, proto):  # noqa: ARG002
        size, stride = ((), ()) if self.zero_d else ((self.numel,), (1,))
        return _REBUILD, (_Storage(self.key, self.numel), 0, size, stride, False, OrderedDict())


class _Storage:
    def __init__(self, key: str, numel: int) -> None:
        self.pid = ("storage", _FLOAT, key, "cpu", numel)


class _Enum:
    def __reduce_ex__(self, proto):  # noqa: ARG002
        return _ENUM, (3,)


def _pickle(value) -> bytes:
    return dumps(value, 2, lambda o: o.pid if isinstance(o, _Storage) else None)


def write_archive(path: Path, value, storages: dict[str, int]) -> None:
    """A STORED zip64 archive ``archive/data.pkl`` + ``archive/data/<key>`` (holes of 4*numel)."""
    entries = [("archive/data.pkl", _pickle(value)), ("archive/byteorder", b"little")]
    entries += [(f"archive/data/{k}", 4 * n) for k, n in storages.items()]
    central = []
    with open(path, "wb") as f:
        for name, data in entries:
            size = len(data) if isinstance(data, bytes) else data
            offset = f.tell()
            extra = struct.pack("<HHQQ", 1, 16, size, size)
            f.write(struct.pack("<4s5H3L2H", b"PK\x03\x04", 45, 0, 0, 0, 0, 0, 0xFFFFFFFF, 0xFFFFFFFF,
                                len(name), len(extra)) + name.encode() + extra)
            if isinstance(data, bytes):
                f.write(data)
            else:
                f.seek(size, os.SEEK_CUR)
            central.append((name, size, offset))
        start = f.tell()
        for name, size, offset in central:
            extra = struct.pack("<HHQQQ", 1, 24, size, size, offset)
            f.write(struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 45, 45, 0, 0, 0, 0, 0, 0xFFFFFFFF, 0xFFFFFFFF,
                                len(name), len(extra), 0, 0, 0, 0, 0xFFFFFFFF) + name.encode() + extra)
        end = f.tell()
        n = len(central)
        f.write(struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, n, n, end - start, start))
        f.write(struct.pack("<4sLQL", b"PK\x06\x07", 0, end, 1))
        f.write(struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0))


def llama_shapes(model: str) -> list[tuple[str, tuple[int, ...]]]:
    vocab, dim, layers, ffn, kv = MODELS[model]
    out = [("tok_embeddings.weight", (vocab, dim))]
    for i in range(layers):
        p = f"layers.{i}."
        out += [(p + "attention.wq.weight", (dim, dim)), (p + "attention.wk.weight", (kv, dim)),
                (p + "attention.wv.weight", (kv, dim)), (p + "attention.wo.weight", (dim, dim)),
                (p + "feed_forward.w1.weight", (ffn, dim)), (p + "feed_forward.w2.weight", (dim, ffn)),
                (p + "feed_forward.w3.weight", (ffn, dim)), (p + "attention_norm.weight", (dim,)),
                (p + "ffn_norm.weight", (dim,))]
    return out + [("norm.weight", (dim,)), ("output.weight", (vocab, dim))]


def sub_groups(shapes: list[tuple[str, tuple[int, ...]]]) -> list[list[tuple[str, tuple[int, ...]]]]:
    """DeepSpeed's ZeRO-3 sub groups: consecutive parameters up to ``sub_group_size`` elements."""
    groups, cur, n = [], [], 0
    for name, shape in shapes:
        cur.append((name, shape))
        n += math.prod(shape)
        if n >= SUB_GROUP:
            groups.append(cur)
            cur, n = [], 0
    return groups + ([cur] if cur else [])


def write_zero3(out: Path, model: str, world: int) -> dict:
    tag = out / "global_step1"
    tag.mkdir(parents=True, exist_ok=True)
    groups = sub_groups(llama_shapes(model))
    lengths = [sum(-(-math.prod(s) // world) for _, s in g) for g in groups]
    hp = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False}
    model_states = {"module": OrderedDict(), "buffer_names": [], "optimizer": None,
                    "param_shapes": [OrderedDict((n, s) for n, s in g) for g in groups],
                    "frozen_param_shapes": OrderedDict(), "shared_params": {}, "frozen_param_fragments": OrderedDict(),
                    "global_steps": 1, "dp_world_size": world, "mp_world_size": 1, "ds_version": "0.19.8"}
    write_archive(tag / "zero_pp_rank_0_mp_rank_00_model_states.pt", model_states, {})
    for rank in range(world):
        storages, state, flats = {}, {}, []
        for k, n in enumerate(lengths):
            base = 4 * k
            for j, name in enumerate(("fp32", "exp_avg", "exp_avg_sq")):
                storages[str(base + j)] = n
            storages[str(base + 3)] = 1
            flats.append(_Tensor(str(base), n))
            state[k] = {"step": _Tensor(str(base + 3), 1, zero_d=True), "exp_avg": _Tensor(str(base + 1), n),
                        "exp_avg_sq": _Tensor(str(base + 2), n)}
        osd = {"zero_stage": _Enum(), "loss_scaler": None, "dynamic_loss_scale": False, "overflow": False,
               "partition_count": world, "fp32_flat_groups": flats,
               "optimizer_state_dict": {"state": state, "param_groups": [{**hp, "params": list(range(len(lengths)))}]}}
        write_archive(tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                      {"optimizer_state_dict": osd, "ds_version": "0.19.8"}, storages)
        if rank:  # the other ranks' model-states files (read only for frozen parameters)
            os.link(tag / "zero_pp_rank_0_mp_rank_00_model_states.pt",
                    tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
    (out / "latest").write_text("global_step1")
    return {"params": sum(math.prod(s) for _, s in llama_shapes(model)), "tensors": len(llama_shapes(model)),
            "sub_groups": len(groups), "world": world}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--model", default="70b", choices=sorted(MODELS))
    p.add_argument("--world", type=int, default=1024)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    info = write_zero3(Path(a.out), a.model, a.world)
    print({**info, "seconds": round(time.perf_counter() - t0, 1)})


if __name__ == "__main__":
    main()
