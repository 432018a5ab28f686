"""``from-universal --format dcp-safetensors`` proved by torch's own reader in real jobs.

A gloo world of the target layout ``dcp.load``-s the output with torch's
``HuggingFaceStorageReader`` (:mod:`hf_storage_load`): every rank's local shards of the model and
its AdamW state are bit for bit what the saving job held, and each rank reads exactly its own
boxes (counted item by item: one chunk per tensor, the one of its own box, from its own file, or,
for a box several ranks hold, from the one holder's file that keeps it).

Sources are real saves (:mod:`hf_storage_factory`) in DCP's safetensors storage and in
``.distcp`` (the shared fixtures): the per-rank form both ways.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import hf_storage_factory as hfs
import hf_storage_load
from converter.commands.from_universal import from_universal
from formats.dcp_safetensors import DCPSafetensorsReader, rank_of_file

CASES = [  # (source kind, target mesh, plan, world layout as the job builds it)
    ("fsdp3", "tp2,dp2", "llama", {"dp": 2, "tp": 2}),
    ("tp2dp2", "dp3", "fsdp", {"dp": 3}),
]


def _check_local_reads(out: Path, reports: dict[int, dict]) -> None:
    """Every rank read each tensor's one chunk: its own box, from the file that holds that box."""
    index = DCPSafetensorsReader(out).index()
    held = {(k, c.box.offsets): c for k, e in index.tensors.items() for c in e.chunks}
    for rank, rep in reports.items():
        assert not rep["errors"], (rank, rep["errors"][:5])
        reads = {(i["key"], tuple(i["offsets"])): i for i in rep["reads"]}
        assert len(reads) == len(rep["reads"]), f"rank {rank} read a chunk twice"
        for key, (offsets, sizes) in rep["local"].items():
            if not all(sizes) and sizes:  # an empty local shard reads nothing
                continue
            item = reads.pop((key, tuple(offsets)), None)
            assert item is not None and tuple(item["sizes"]) == tuple(sizes), (rank, key, offsets, sizes)
            assert item["file"] == held[(key, tuple(offsets))].file, (rank, key)
        assert not reads, f"rank {rank} read chunks it does not hold: {sorted(reads)[:3]}"
        own = [i for i in rep["reads"] if rank_of_file(i["file"]) == rank]
        assert own, f"rank {rank} read nothing from its own file"


@pytest.mark.parametrize("kind,mesh,plan,layout", CASES, ids=[f"{c[0]}-to-{c[1]}" for c in CASES])
def test_torch_loads_the_per_rank_form_bit_exact_and_rank_local(tmp_path, kind, mesh, plan, layout):
    out = tmp_path / "out"
    from_universal(hfs.shards(kind), out, mesh, plan=plan, format="dcp-safetensors")
    reports = hf_storage_load.load_in_world(layout, out, hfs.get(kind) / hfs.REFERENCE, tmp_path / "reports")
    _check_local_reads(out, reports)


def test_consolidated_beside_sharded_loads_too(tmp_path):
    """--consolidate: torch loads sharded/ rank-locally, and the hub-shaped folder whole."""
    out = tmp_path / "out"
    from_universal(hfs.shards("fsdp3"), out, "dp2", format="dcp-safetensors", consolidate=True, max_shard_size="64KB")
    reports = hf_storage_load.load_in_world({"dp": 2}, out / "sharded", hfs.get("fsdp3") / hfs.REFERENCE,
                                            tmp_path / "r1")
    _check_local_reads(out / "sharded", reports)
    ref = hfs.reference("fsdp3")
    got = hfs.torch_hf_read(out)
    assert set(got) == set(ref)
    from oracle import bits_equal

    bad = [k for k in ref if not bits_equal(got[k], ref[k])]
    assert not bad, bad[:5]


def test_expert_parallel_target_loads_rank_locally(tmp_path):
    """An MoE block under EP (grouped experts Shard(0) over ep, FSDP over efsdp, as torchtitan lays
    them out): converted to ``dp4,ep2`` from a universal store of the EP save, loaded by the same EP
    world rank-locally and bit-exact."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "rules": [
        {"name": "experts", "match": "inner_experts\\.w.*", "experts": True},
        {"name": "rest", "match": ".*", "tp": "replicate", "dp_shard": "shard(0)"}]}))
    from cli_runner import run_cli

    assert run_cli("to-universal", str(hfs.shards("ep2dp2")), str(tmp_path / "uni"))[0] == 0
    out = tmp_path / "out"
    from_universal(tmp_path / "uni", out, "dp4,ep2", plan=str(plan), format="dcp-safetensors")
    reports = hf_storage_load.load_in_world({"dp": 4}, out, hfs.get("ep2dp2") / hfs.REFERENCE, tmp_path / "r",
                                            model="moe")
    _check_local_reads(out, reports)
