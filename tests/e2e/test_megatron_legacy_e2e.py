"""Megatron-LM legacy checkpoints converted by ckptconv and loaded by megatron-core 0.19.2's own
``dist_checkpointing.load`` into real GPTModels with their DistributedOptimizers, bit-exact, and legacy
checkpoints WRITTEN by ckptconv (``from-universal --format megatron-legacy``) loaded as Megatron-LM's
``load_checkpoint`` does with ``--ckpt-format torch`` (``torch.load`` of the rank's
``model_optim_rng.pt``, ``load_state_dict(strict=True)`` of every model chunk, the optimizer's
``load_state_dict`` and ``load_parameter_state(distrib_optim.pt)``), bit-exact (``-m slow``: multi-process
gloo runs of megatron's own code).

Each source is one training run saved twice from the same state: in Megatron-LM's legacy format
(``megatron_support.save_legacy``) and by megatron's torch_dist ``dist_checkpointing.save``. ckptconv
converts the LEGACY one (through the universal store) to torch_dist on a target layout; megatron then
loads the torch_dist save (megatron reshards its own checkpoints on load: the oracle) and the
conversion into two models on that layout, and every model parameter, fp32 main param, Adam state
and step, param group, iteration and checkpoint_version must be equal bit for bit on every rank.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

import megatron_support as ms
from cli_runner import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.framework("megatron")]

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "megatron" / "legacy_tp2_pp2_vpp2"
MOE = ms.GPTSpec(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=24,
                 vocab_size=32, seq_len=8, num_experts=4, moe_ffn_hidden_size=16, init_std=0.3)  # (16: bf16 rows of 32 bytes, as transformers' grouped matmul needs)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    reason = ms.skip_reason()
    if reason:
        pytest.skip(reason)
    return _Sources(tmp_path_factory.mktemp("legacy"))


class _Sources(dict):
    """(legacy folder, torch_dist folder, spec) per name; saved by megatron on first use."""

    def __init__(self, root: Path) -> None:
        super().__init__({"tp2,pp2,vpp2": (FIXTURE / "legacy", FIXTURE / "torch_dist", ms.SMALL)})
        self.root = root

    def __missing__(self, name: str):
        base = self.root / name.replace(",", "_")
        if name == "tp2,dp2":
            ms.save_checkpoint(base / "torch_dist", 2, 1, 2, ms.SMALL, work=base / "run", legacy=base / "legacy")
            spec = ms.SMALL
        elif name == "moe,ep2,dp2":
            ms.save_checkpoint(base / "torch_dist", 1, 1, 2, MOE, work=base / "run", ep=2, legacy=base / "legacy")
            spec = MOE
        elif name == "moe,tp2,dp2,ep2,etp1":  # expert TP 1 under TP 2: experts whole, over EP 2
            ms.save_checkpoint(base / "torch_dist", 2, 1, 2, MOE, work=base / "run", ep=2, etp=1, legacy=base / "legacy")
            spec = MOE
        else:
            raise KeyError(name)
        self[name] = (base / "legacy", base / "torch_dist", spec)
        return self[name]


CASES = [  # (source, target mesh, layout megatron loads with)
    ("tp2,pp2,vpp2", "tp2,pp2", dict(tp=2, pp=2, dp=1, vpp=2)),  # same layout
    ("tp2,pp2,vpp2", "tp2", dict(tp=2, pp=1, dp=1)),  # PP2 x VPP2 -> PP1
    ("tp2,pp2,vpp2", "dp2", dict(tp=1, pp=1, dp=2)),  # TP2 -> TP1, PP and DP change
    ("tp2,dp2", "tp2,dp2", dict(tp=2, pp=1, dp=2)),  # the optimizer sharded over DP 2 in the flat buffers
    ("tp2,dp2", "pp2,tp2", dict(tp=2, pp=2, dp=1)),
    ("moe,ep2,dp2", "dp2", dict(tp=1, pp=1, dp=2, ep=2)),  # experts over EP 2, their own optimizer
]


@pytest.mark.parametrize("src,mesh,load", CASES, ids=[f"{s}-to-{m}" for s, m, _ in CASES])
def test_megatron_loads_the_converted_legacy_checkpoint_bit_exact(sources, tmp_path, src, mesh, load):
    legacy, dist, spec = sources[src]
    t0 = time.time()
    code, _, err = run_cli("to-universal", str(legacy), str(tmp_path / "store"))
    assert code == 0, err
    out = tmp_path / "out"
    code, _, err = run_cli("from-universal", str(tmp_path / "store"), str(out), "--mesh", mesh)
    assert code == 0, err
    t1 = time.time()
    reports = ms.load_and_compare(dist, out, work=tmp_path / "load", spec=spec,
                                  common=("iteration", "checkpoint_version"), **load)
    for rep in reports:
        assert rep["mismatch"] == [], (rep["rank"], rep["mismatch"][:5])
        assert rep["compared"] >= 20 and rep["iteration"] == 2
    print(f"\nlegacy {src} -> {mesh}: convert {t1 - t0:.1f} s, megatron load+compare {time.time() - t1:.1f} s, "
          f"{len(reports)} ranks, {sum(r['compared'] for r in reports)} values compared")


TARGET_CASES = [  # (source, which of its two saves, target mesh, vpp, layout megatron loads with)
    ("tp2,pp2,vpp2", "torch_dist", "tp2,pp2", 2, dict(tp=2, pp=2, dp=1, vpp=2)),  # torch_dist -> legacy, same layout
    ("tp2,pp2,vpp2", "legacy", "dp2", 1, dict(tp=1, pp=1, dp=2)),  # TP, PP, VPP and DP change
    ("tp2,pp2,vpp2", "legacy", "pp2,dp2", 1, dict(tp=1, pp=2, dp=2)),
    ("tp2,dp2", "legacy", "pp2,tp2", 2, dict(tp=2, pp=2, dp=1, vpp=2)),  # PP1 -> PP2 x VPP2
    ("moe,ep2,dp2", "legacy", "dp2,ep2", 1, dict(tp=1, pp=1, dp=2, ep=2)),  # experts' own optimizer
    ("moe,ep2,dp2", "torch_dist", "tp2,dp2,ep2", 1, dict(tp=2, pp=1, dp=2, ep=2)),  # expert TP 1 -> 2
]


@pytest.mark.parametrize("src,which,mesh,vpp,load", TARGET_CASES,
                         ids=[f"{s}-{w}-to-legacy-{m}{'-vpp' + str(v) if v > 1 else ''}"
                              for s, w, m, v, _ in TARGET_CASES])
def test_megatron_loads_the_written_legacy_checkpoint_bit_exact(sources, tmp_path, src, which, mesh, vpp, load):
    legacy, dist, spec = sources[src]
    t0 = time.time()
    out = tmp_path / "out"
    code, _, err = run_cli("from-universal", str(legacy if which == "legacy" else dist), str(out), "--mesh", mesh,
                           "--vpp", str(vpp), "--format", "megatron-legacy", "--megatron-names", "local")
    assert code == 0, err
    t1 = time.time()
    reports = ms.load_and_compare(dist, out, work=tmp_path / "load", spec=spec, converted_format="legacy",
                                  common=("iteration", "checkpoint_version"), **load)
    for rep in reports:
        assert rep["mismatch"] == [], (rep["rank"], rep["mismatch"][:5])
        assert rep["compared"] >= 20 and rep["iteration"] == 2
    print(f"\n{src} ({which}) -> legacy {mesh} vpp{vpp}: convert {t1 - t0:.1f} s, megatron legacy load+compare "
          f"{time.time() - t1:.1f} s, {len(reports)} ranks, {sum(r['compared'] for r in reports)} values compared")


RESHARDABLE_CASES = [  # (target mesh, layout megatron loads with): the dp_reshardable TP2 x DP2 save
    ("pp2,tp2", dict(tp=2, pp=2, dp=1)),  # PP 1 -> 2
    ("dp4", dict(tp=1, pp=1, dp=4)),  # TP 2 -> 1
]


@pytest.mark.parametrize("mesh,load", RESHARDABLE_CASES, ids=[m for m, _ in RESHARDABLE_CASES])
def test_dp_reshardable_optimizer_survives_a_layout_change(sources, tmp_path, mesh, load):
    """Megatron-LM's default optimizer format reshards over DP only; converted offline to
    fully_reshardable it loads on another TP / PP layout, bit-exact against megatron's own load of the
    same state saved fully_reshardable."""
    reason = ms.skip_reason()
    if reason:
        pytest.skip(reason)
    base = tmp_path / "src"
    spec = replace(ms.SMALL, sharding="dp_reshardable")
    ms.save_checkpoint(base / "dpr", 2, 1, 2, spec, work=base / "run", also={"fully_reshardable": base / "full"})
    code, _, err = run_cli("to-universal", str(base / "dpr"), str(tmp_path / "store"))
    assert code == 0, err
    code, _, err = run_cli("from-universal", str(tmp_path / "store"), str(tmp_path / "out"), "--mesh", mesh)
    assert code == 0, err
    assert "--no-load-optim" not in err
    reports = ms.load_and_compare(base / "full", tmp_path / "out", work=tmp_path / "load", spec=ms.SMALL,
                                  common=("iteration", "checkpoint_version"), **load)  # (args name the sharding)
    for rep in reports:
        assert rep["mismatch"] == [], (rep["rank"], rep["mismatch"][:5])
        assert rep["compared"] >= 20


MOE_CASES = [  # torch_dist MoE (EP2 x DP2) -> the store -> torch_dist on mesh; megatron loads with layout
    ("dp4", dict(tp=1, pp=1, dp=4, ep=4)),  # one expert per rank
    ("tp2,dp2", dict(tp=2, pp=1, dp=2, ep=2)),  # TP2 and expert TP2
    ("pp2,dp2", dict(tp=1, pp=2, dp=2, ep=2)),  # a layer per stage
]


@pytest.mark.parametrize("mesh,load", MOE_CASES, ids=[m for m, _ in MOE_CASES])
def test_moe_between_expert_layouts_loads_bit_exact(sources, tmp_path, mesh, load):
    """megatron-core's MoE layer (SequentialMLP experts, top-2 router) saved by megatron at EP2 x DP2
    (torch_dist), converted through the store and loaded at another EP / expert-TP / PP layout:
    equal bit for bit to megatron's own load of its save on that layout (experts' own optimizer)."""
    _, dist, spec = sources["moe,ep2,dp2"]
    code, _, err = run_cli("to-universal", str(dist), str(tmp_path / "store"))
    assert code == 0, err
    code, _, err = run_cli("from-universal", str(tmp_path / "store"), str(tmp_path / "out"), "--mesh", mesh)
    assert code == 0, err
    reports = ms.load_and_compare(dist, tmp_path / "out", work=tmp_path / "load", spec=spec,
                                  common=("iteration", "checkpoint_version", "args"), **load)
    for rep in reports:
        assert rep["mismatch"] == [], (rep["rank"], rep["mismatch"][:5])
        assert rep["compared"] >= 20


@pytest.mark.framework("transformers")  # and megatron (the module's mark)
def test_moe_export_hf_runs_like_megatron(sources, tmp_path):
    """export-hf --map megatron-mixtral of megatron-core's MoE model (saved at EP2 x DP2), loaded by
    transformers' MixtralForCausalLM.from_pretrained, gives megatron's own logits (its GPTModel with the
    MoE layer loaded by dist_checkpointing.load, forward on CPU) within 4 bf16 ulps of the largest
    logit (bf16 both sides, through top-2 routers); two experts exchanged (the expert order) miss by far more."""
    import json

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import MixtralForCausalLM

    legacy, dist, spec = sources["moe,ep2,dp2"]
    tokens = [[1, 5, 9, 2, 30, 17, 7, 7, 12, 20, 3, 18, 25, 31, 0, 11][: spec.seq_len]]
    code, _, err = run_cli("export-hf", str(dist), str(tmp_path / "hf"), "--map", "megatron-mixtral",
                           "--config", '{"rms_norm_eps": 1e-05, "rope_theta": 10000.0}')
    assert code == 0, err
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"]) == \
        (spec.num_experts, spec.moe_router_topk, spec.moe_ffn_hidden_size)
    want = ms.forward_logits(dist, tokens, tmp_path / "fwd", spec)

    def logits(folder):
        model = MixtralForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16).eval()
        with torch.no_grad():
            return model(torch.tensor(tokens)).logits.float()

    got = logits(tmp_path / "hf")
    # bf16 on both sides, through two routers: within 4 bf16 ulps of the largest logit (or of 1)
    tol = 4 * 2.0 ** -8 * max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() <= tol
    swapped = load_file(tmp_path / "hf" / "model.safetensors")  # experts 0 and 1 of every layer exchanged
    for layer in range(spec.num_layers):
        for w in ("w1", "w2", "w3"):
            a, b = (f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight" for e in (0, 1))
            swapped[a], swapped[b] = swapped[b], swapped[a]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    save_file(swapped, str(bad / "model.safetensors"), metadata={"format": "pt"})
    miss = (logits(bad) - want).abs().max().item()
    assert miss > 10 * tol, (miss, tol)
    # the legacy save of the same state exports the same tensors
    code, _, err = run_cli("export-hf", str(legacy), str(tmp_path / "hf2"), "--map", "megatron-mixtral",
                           "--config", '{"rms_norm_eps": 1e-05, "rope_theta": 10000.0}')
    assert code == 0, err
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf2" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(f"\nHF Mixtral vs megatron MoE logits: max abs diff {(got - want).abs().max().item():.4g} (tol {tol:.3g}); "
          f"experts 0 and 1 exchanged {miss:.3g}")


def _read_classes(reports: list[dict]) -> list[tuple[int, int, int, list]]:
    """Per rank: (bytes of chunks only it reads, from its own file; bytes of chunks several ranks read;
    its rank; chunks only it reads that came from another rank's file)."""
    readers: dict[tuple, set] = {}
    for rep in reports:
        for key, offsets, _, _ in rep["reads"]:
            readers.setdefault((key, tuple(offsets)), set()).add(rep["rank"])
    out = []
    for rep in reports:
        own, shared, foreign = 0, 0, []
        for key, offsets, name, n in rep["reads"]:
            if len(readers[(key, tuple(offsets))]) > 1:
                shared += n
            elif name == f"__{rep['rank']}_0.distcp":
                own += n
            else:
                foreign.append((key, offsets, name))
        out.append((own, shared, rep["rank"], foreign))
    return out


LOCAL_CASES = [  # (source, target mesh, vpp, --plan, layout megatron loads with)
    ("tp2,pp2,vpp2", "pp2,tp2", 2, "megatron-core", dict(tp=2, pp=2, dp=1, vpp=2)),
    ("tp2,dp2", "pp2,tp2", 1, "megatron-core", dict(tp=2, pp=2, dp=1)),
    ("moe,ep2,dp2", "dp2,ep2", 1, "megatron-core", dict(tp=1, pp=1, dp=2, ep=2)),  # each expert rank's experts in its own file
    ("moe,ep2,dp2", "tp2,dp2,ep2", 1, None, dict(tp=2, pp=1, dp=2, ep=2)),  # no --plan: TP x EP, experts' TP too
    ("moe,ep2,dp2", "pp2,dp2,ep2", 1, None, dict(tp=1, pp=2, dp=2, ep=2)),  # no --plan: PP x EP
    ("tp2,pp2,vpp2", "tp2", 1, None, dict(tp=2, pp=1, dp=1)),  # no --plan: TP (stages merged)
    ("moe,ep2,dp2", "dp2,ep2", 1, None, dict(tp=1, pp=1, dp=2, ep=2)),  # no --plan: EP
]


@pytest.mark.parametrize("src,mesh,vpp,plan,load", LOCAL_CASES,
                         ids=[f"{s}-to-{m}-{p or 'auto'}" for s, m, _, p, _ in LOCAL_CASES])
def test_megatron_code_plan_is_rank_local(sources, tmp_path, src, mesh, vpp, plan, load):
    """--plan megatron-core, and no --plan (auto: megatron-core's plan, the checkpoint's args being
    Megatron-LM's): megatron loads the conversion bit-exact, and every chunk only one rank loads (its
    TP / PP / expert shard) it reads from its own file (read counts of torch's FileSystemReader under
    megatron's dist_checkpointing.load). The name-rule plan (--plan megatron, layer axis never split,
    experts whole over ep) of the same source makes ranks read chunks only they load from other
    ranks' files: the counts tell the two apart."""
    legacy, dist, spec = sources[src]
    out = tmp_path / "out"
    code, _, err = run_cli("from-universal", str(legacy), str(out), "--mesh", mesh, "--vpp", str(vpp),
                           *(("--plan", plan) if plan else ()))
    assert code == 0, err
    if plan is None:
        assert "plan megatron-core (--plan auto): Megatron-core names with their training args" in err, err
    reports = ms.load_and_compare(dist, out, work=tmp_path / "load", spec=spec, count_reads=True,
                                  common=("iteration", "checkpoint_version"), **load)
    for rep in reports:
        assert rep["mismatch"] == [], (rep["rank"], rep["mismatch"][:5])
        assert rep["compared"] >= 20
    for own, shared, rank, foreign in _read_classes(reports):
        assert foreign == [], f"rank {rank} read chunks only it loads from other ranks' files: {foreign[:4]}"
        assert own > 0, rank
    manifest = json.loads((out / ".ckptconv-loads.json").read_text())  # the files ckptconv says each rank opens
    for rep in reports:
        listed = {manifest["files"][i] for i in manifest["loads"][rep["rank"]]}
        assert {name for *_, name, _ in rep["reads"]} <= listed, rep["rank"]
    if load["pp"] > 1 or load.get("ep", 1) > 1:  # the name-rule plan is not rank-local over stages or experts
        code, _, err = run_cli("from-universal", str(legacy), str(tmp_path / "rules"), "--mesh", mesh, "--plan",
                               "megatron")
        assert code == 0, err
        rules = ms.load_and_compare(dist, tmp_path / "rules", work=tmp_path / "load2", spec=spec, count_reads=True,
                                    common=("iteration", "checkpoint_version"), **load)
        assert _foreign_bytes(rules) > _foreign_bytes(reports)
        print(f"\nbytes read from other ranks' files: --plan megatron {_foreign_bytes(rules)}, "
              f"--plan {plan or 'auto'} {_foreign_bytes(reports)}")
    print("\n" + "; ".join(f"rank {r}: own {o} B, shared {s} B" for o, s, r, _ in _read_classes(reports)))


def _foreign_bytes(reports: list[dict]) -> int:
    """Bytes the ranks' loads read from other ranks' files, all ranks together."""
    return sum(n for rep in reports for _, _, name, n in rep["reads"] if name != f"__{rep['rank']}_0.distcp")


def test_expert_tp_other_than_tp_converts_bit_exact_and_rank_local(sources, tmp_path):
    """megatron's expert_tensor_parallel_size other than TP, both ways: a save at TP2 x DP2 with the
    experts at ETP1 x EP2 (torch_dist, and the legacy save of the same state: folders
    mp_rank_<tp>_<ep>, the experts whole) converted to TP1 x DP4 with the experts at ETP2 x EP2
    (``--mesh dp4,ep2,etp2``: --plan megatron-core for the torch_dist save, no --plan for the legacy
    one: auto, megatron-core's plan from its args); megatron loads both conversions on that layout
    (``initialize_model_parallel(expert_tensor_parallel_size=2)``) equal bit for bit to its own load
    of its torch_dist save there, and every chunk only one rank loads (its expert TP x EP shard) it
    reads from its own file."""
    legacy, dist, spec = sources["moe,tp2,dp2,ep2,etp1"]
    t0 = time.time()
    outs = []
    for src, plan in ((dist, ("--plan", "megatron-core")), (legacy, ())):
        out = tmp_path / f"out{len(outs)}"
        code, _, err = run_cli("from-universal", str(src), str(out), "--mesh", "dp4,ep2,etp2", *plan)
        assert code == 0, err
        assert "on dp_shard4,ep2,etp2" in err, err
        outs.append(out)
    t1 = time.time()
    reports = ms.load_and_compare(dist, outs[0], tp=1, pp=1, dp=4, ep=2, etp=2, work=tmp_path / "load", spec=spec,
                                  count_reads=True, also=(outs[1],), common=("iteration", "checkpoint_version"))
    for name, reps in (("torch_dist", reports), ("legacy", [dict(r["also"][0], rank=r["rank"]) for r in reports])):
        for rep in reps:
            assert rep["mismatch"] == [], (name, rep["rank"], rep["mismatch"][:5])
            assert rep["compared"] >= 20 and rep["iteration"] == 2
        for own, shared, rank, foreign in _read_classes(reps):
            assert foreign == [], f"{name}: rank {rank} read chunks only it loads from other ranks' files: {foreign[:4]}"
            assert own > 0, (name, rank)
    expert_rows = {r["rank"]: sorted({tuple(o) for k, o, *_ in r["reads"] if k.endswith("experts.linear_fc1.weight")})
                   for r in reports}
    assert expert_rows[0] != expert_rows[1] and expert_rows[0] != expert_rows[2]  # etp and ep shards differ
    print(f"\nETP1 x EP2 (TP2) -> ETP2 x EP2 (TP1): convert both {t1 - t0:.1f} s, megatron load+compare "
          f"{time.time() - t1:.1f} s, {sum(r['compared'] + r['also'][0]['compared'] for r in reports)} values; "
          + "; ".join(f"rank {r}: own {o} B, shared {s} B" for o, s, r, _ in _read_classes(reports)))
