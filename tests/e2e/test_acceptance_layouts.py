"""Acceptance run on models, shapes and layouts the main fixtures do not have
(:mod:`acceptance_factory`: a non-Llama model with biases, LayerNorm, conv, tied embeddings,
persistent buffers, a (2,) parameter on 3 ranks, odd sizes; FSDP2 on 3 ranks, custom TP on 3
ranks, HSDP 2x3, TP2 x FSDP3, torchtitan keys with TP on dims 1 and 2, DDP, FSDP1, many files
per rank, a plain single-process dict of every dtype; Adam(amsgrad), SGD(momentum), Adagrad).

Oracles, never our reader: torch's ``dcp_to_torch_save`` of the source and of every output,
compared bit for bit (every tensor and every non-tensor entry); the chunk boxes torch itself
saved (``--plan source`` / same-layout targets must reproduce them); real gloo worlds of the
target layout that ``dcp.load`` the output into the parallelized model and optimizer, compare
each shard, and train one more step (bit-equal loss on the saving layout).

Default suite: a few high-value cases; ``-m slow`` runs the whole matrix.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jsonschema
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import acceptance_factory as af
from converter import api
from converter.config import RunOptions
from converter.plan.mesh import parse_mesh
from cli_runner import run_cli
from oracle import assert_same_value, torch_reference

OPTS = RunOptions(workers=2)
SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"
STORE_CHUNK_BYTES = 256  # several zarr chunks per tensor: plans must intersect boxes
LOSS_RTOL = 1e-5


class Workspace:
    """Stores, conversions and torch references, each made once per module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._stores: dict[str, Path] = {}
        self._refs: dict[str, dict] = {}
        self._outs: dict[tuple, tuple[Path, tuple[str, ...]]] = {}

    def source(self, kind: str) -> Path:
        return af.get(kind)

    def store(self, kind: str) -> Path:
        if kind not in self._stores:
            dst = self.root / f"uni-{kind}"
            api.to_universal(self.source(kind), dst, OPTS, chunk_bytes=STORE_CHUNK_BYTES)
            self._stores[kind] = dst
        return self._stores[kind]

    def ref(self, kind: str) -> dict:
        if kind not in self._refs:
            self._refs[kind] = torch_reference(self.source(kind))
        return self._refs[kind]

    def ref_file(self, kind: str) -> Path:
        path = self.root / f"ref-{kind}.pt"
        if not path.exists():
            torch.save(self.ref(kind), path)
        return path

    def convert(self, kind: str, mesh: str, plan: str, via_store: bool = True) -> tuple[Path, tuple[str, ...]]:
        key = (kind, mesh, plan, via_store)
        if key not in self._outs:
            out = self.root / f"out{len(self._outs)}-{kind}"
            src = self.store(kind) if via_store else self.source(kind)
            result = api.from_universal(src, out, mesh, plan=plan, options=OPTS)
            self._outs[key] = (out, result.warnings)
        return self._outs[key]


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("acceptance"))


def saved_boxes(path: Path) -> dict[str, list]:
    """Per tensor key, the sorted chunk boxes of a DCP checkpoint, read by torch."""
    md = FileSystemReader(str(path)).read_metadata()
    return {k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks)
            for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def world_layout(mesh: str) -> dict[str, int]:
    """The acceptance_factory layout of a --mesh (dims in rank order, outermost first; FSDP alone
    is "dp"; a world of one process is {})."""
    dims = {d.name: d.size for d in parse_mesh(mesh).dims}
    if "dp_replicate" not in dims and "dp_shard" in dims:
        dims = {("dp" if n == "dp_shard" else n): s for n, s in dims.items()}
    return dims if math.prod(dims.values()) > 1 else {}


# ----------------------------------------------------------------------------- the matrix

MODEL_KINDS = ("mlp_fsdp3", "mlp_tp3", "mlp_hsdp2x3", "mlp_tp2fsdp3", "titan_dp2tp2", "titan_dp2tp3",
               "hsdp_tp_2x2x2", "ddp2", "fsdp1_3", "fsdp2_multifile", "app_fsdp2")
TARGETS = (("dp1", "fsdp"), ("dp2", "fsdp"), ("dp3", "fsdp"), ("dp7", "fsdp"), ("tp2", "fsdp"),
           ("tp2,dp2", "fsdp"), ("tp2,dp2", "source"), ("tp3", "source"), ("dp_replicate2,dp3", "fsdp"),
           ("tp2,dp3", "source"), ("pp2,dp2", "fsdp"), ("cp2,dp2", "fsdp"))
DEFAULT_MATRIX = {
    ("mlp_fsdp3", "dp2", "fsdp", True),
    ("mlp_fsdp3", "tp2,dp2", "source", False),
    ("mlp_tp2fsdp3", "tp3", "source", True),
    ("mlp_tp2fsdp3", "dp3", "fsdp", False),
    ("titan_dp2tp2", "tp2,dp3", "source", True),
    ("plain_dtypes", "dp3", "fsdp", True),
}
ALL_MATRIX = [(k, m, p, v) for k in (*MODEL_KINDS, "plain_dtypes") for m, p in TARGETS for v in (True, False)]


def _case_id(case) -> str:
    kind, mesh, plan, via = case
    return f"{kind}->{mesh}({plan}){'' if via else '[direct]'}"


def check_converted(ws: Workspace, kind: str, mesh: str, plan: str, via_store: bool) -> None:
    out, warnings = ws.convert(kind, mesh, plan, via_store)
    assert not [w for w in warnings if "matched no rule" in w], warnings
    assert_same_value(ws.ref(kind), torch_reference(out), f"{kind}->{mesh}")


@pytest.mark.parametrize("case", sorted(DEFAULT_MATRIX), ids=_case_id)
def test_converted_equals_source(ws, case):
    check_converted(ws, *case)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in ALL_MATRIX if c not in DEFAULT_MATRIX], ids=_case_id)
def test_converted_equals_source_matrix(ws, case):
    check_converted(ws, *case)


# ----------------------------------------------------------------------------- boxes torch saved

SAME_LAYOUT = {  # kind -> the --mesh/--plan describing the layout it was saved with
    "mlp_tp2fsdp3": ("tp2,dp3", "source"),
    "titan_dp2tp2": ("tp2,dp2", "source"),  # TP Shard(1) embedding, Shard(2) 3-D parameter
    "titan_dp2tp3": ("tp3,dp2", "source"),  # the same, uneven (14 and 10 over 3)
    "hsdp_tp_2x2x2": ("dp_replicate2,dp2,tp2", "source"),  # HSDP x TP: TP dims from replica-deduped chunks
    "mlp_hsdp2x3": ("dp_replicate2,dp3", "fsdp"),
    "mlp_tp3": ("tp3", "source"),
    "mlp_fsdp3": ("dp3", "fsdp"),
    "fsdp2_multifile": ("dp2", "fsdp"),
    "ddp2": ("dp_replicate2", "fsdp"),
    "app_fsdp2": ("dp2", "fsdp"),  # {"app": AppState}: roots under a prefix
}
DEFAULT_SAME = ("mlp_tp2fsdp3", "titan_dp2tp2", "mlp_hsdp2x3", "app_fsdp2")


def check_same_layout(ws: Workspace, kind: str) -> None:
    mesh, plan = SAME_LAYOUT[kind]
    out, _ = ws.convert(kind, mesh, plan)
    want, got = saved_boxes(ws.source(kind)), saved_boxes(out)
    bad = {k: (want[k], got.get(k)) for k in want if want[k] != got.get(k)}
    assert not bad, f"{len(bad)} keys with other boxes than torch saved, e.g. {next(iter(bad.items()))}"
    assert set(got) == set(want)


@pytest.mark.parametrize("kind", DEFAULT_SAME)
def test_same_layout_reproduces_saved_boxes(ws, kind):
    check_same_layout(ws, kind)


@pytest.mark.slow
@pytest.mark.parametrize("kind", [k for k in SAME_LAYOUT if k not in DEFAULT_SAME])
def test_same_layout_reproduces_saved_boxes_more(ws, kind):
    check_same_layout(ws, kind)


# ----------------------------------------------------------------------------- real loads

LOADS = (  # kind, mesh, plan; "same": the saving layout, whose continuation loss must be bit-equal
    ("titan_dp2tp2", "tp3", "source"),  # uneven TP on dims 1 and 2, 3 ranks
    ("mlp_fsdp3", "dp3", "fsdp"),  # same layout: bit-equal continuation (empty shard of the (2,) param)
    ("mlp_tp2fsdp3", "tp2,dp3", "source"),
    ("titan_dp2tp2", "tp2,dp2", "source"),
    ("mlp_hsdp2x3", "dp_replicate2,dp3", "fsdp"),
    ("mlp_tp3", "tp3", "source"),
    ("mlp_fsdp3", "tp2,dp2", "fsdp"),
    ("titan_dp2tp3", "tp3,dp2", "source"),
    ("hsdp_tp_2x2x2", "dp_replicate2,dp2,tp2", "source"),
    ("titan_dp2tp2", "tp3,dp2", "source"),
    ("mlp_tp3", "dp1", "fsdp"),
    ("ddp2", "dp2", "fsdp"),
    ("fsdp1_3", "dp2", "fsdp"),
    ("fsdp2_multifile", "dp3", "fsdp"),
    ("app_fsdp2", "dp3", "fsdp"),
)
DEFAULT_LOADS = LOADS[:2]


def check_load(ws: Workspace, kind: str, mesh: str, plan: str) -> None:
    out, _ = ws.convert(kind, mesh, plan)
    layout = world_layout(mesh)
    reports = af.load_in_world(kind, layout, out, ws.ref_file(kind), ws.root / f"load-{kind}-{mesh}-{plan}")
    want = af.info(kind)["ranks"]
    for rank, rep in reports.items():
        assert "exception" not in rep, f"rank {rank}: {rep['exception']}"
        assert rep["errors"] == [], f"rank {rank}: {rep['errors']}"
        got, source = rep["losses"][0], want["0"]["continue"][0]
        if layout == af.KINDS[kind].layout_dict:
            assert rep["losses"] == want[str(rank)]["continue"], (rank, rep["losses"], want[str(rank)])
        else:
            assert abs(got - source) <= LOSS_RTOL * abs(source), (rank, got, source)
    loaded = set().union(*(rep["keys"] for rep in reports.values()))
    assert loaded == set(ws.ref(kind)), sorted(set(ws.ref(kind)) ^ loaded)[:5]


@pytest.mark.parametrize("kind,mesh,plan", DEFAULT_LOADS)
def test_loads_in_target_world(ws, kind, mesh, plan):
    check_load(ws, kind, mesh, plan)


@pytest.mark.slow
@pytest.mark.parametrize("kind,mesh,plan", LOADS[len(DEFAULT_LOADS):])
def test_loads_in_target_world_more(ws, kind, mesh, plan):
    check_load(ws, kind, mesh, plan)


# ----------------------------------------------------------------------------- the CLI


def check_cli(ws: Workspace, kind: str) -> None:
    src = str(ws.source(kind))
    code, out, err = run_cli("inspect", src)
    assert code == 0 and "not covered" not in out and "irregular" not in out, (err, out[-2000:])
    code, out, err = run_cli("inspect", src, "--json")
    assert code == 0, err
    doc = json.loads(out)
    jsonschema.validate(doc, json.loads((SCHEMAS / "inspect.schema.json").read_text()))
    assert not doc["layout"]["notes"], doc["layout"]["notes"]
    assert run_cli("inspect", src, "--stats", "*")[0] == 0
    assert run_cli("verify", src)[0] == 0
    assert run_cli("verify", str(ws.store(kind)))[0] == 0
    out_dir, _ = ws.convert(kind, "dp2", "fsdp")
    code, out, err = run_cli("diff", src, str(out_dir))
    assert code == 0 and "same:" in out, (err, out[-1000:])
    hf, back = ws.root / f"hf-{kind}", ws.root / f"hf-uni-{kind}"
    assert run_cli("export-hf", str(ws.store(kind)), str(hf), "--no-progress")[0] == 0
    assert run_cli("import-hf", str(hf), str(back), "--no-progress")[0] == 0
    code, out, err = run_cli("diff", str(hf), str(back))
    assert code == 0, out[-1000:]


@pytest.mark.parametrize("kind", ["titan_dp2tp2", "plain_dtypes"])
def test_cli_commands(ws, kind):
    check_cli(ws, kind)


@pytest.mark.slow
@pytest.mark.parametrize("kind", [k for k in MODEL_KINDS if k != "titan_dp2tp2"])
def test_cli_commands_more(ws, kind):
    check_cli(ws, kind)


def test_app_state_prefix_is_a_model(ws):
    """DCP's tutorial layout {"app": AppState}: its model weights export, its parameters shard."""
    hf = ws.root / "hf-app"
    api.export_hf(ws.store("app_fsdp2"), hf, options=OPTS)
    names = {t["key"] for t in json.loads(run_cli("inspect", str(hf), "--json")[1])["tensors"]}
    assert "embed.weight" in names and not any(n.startswith("app.") for n in names)
    code, out, _ = run_cli("inspect", str(ws.source("app_fsdp2")))
    assert "tensors under 'app.model'" in out


def test_errors_are_one_line(ws):
    """Refusals on the acceptance sources: exit 2, one line, no traceback."""
    uni = str(ws.store("mlp_tp2fsdp3"))
    plan = ws.root / "bias-dim1.json"
    plan.write_text(json.dumps({"version": 1, "rules": [{"name": "b", "match": r".*\.bias", "tp": "shard(1)"}]}))
    cases = [
        ("from-universal", uni, str(ws.root / "e1"), "--mesh", "tp2,dp2", "--plan", str(plan)),  # dim 1 of a bias
        ("from-universal", uni, str(ws.root / "e2"), "--mesh", "pp3,dp2"),  # no layers to split
        ("from-universal", uni, str(ws.root / "e3"), "--mesh", "dp2", "--dtype", "int8"),
        ("inspect", uni, "--stats", "nosuchkey"),
    ]
    for args in cases:
        code, out, err = run_cli(*args)
        assert code == 2, (args, code, out, err)
        assert err.startswith("ckptconv: error: ") and err.count("\n") == 1 and "Traceback" not in err, (args, err)
