"""Issue 18.2: ``--keys PATTERN`` (glob / ``re:``), ``--model-only`` and ``--optim-only`` on
to-universal and from-universal; a selection that matches nothing is a one-line error.

Sources are real multi-process saves (fixtures) and the bundled FSDP2 demo; every output is read
back by torch's own ``dcp.load`` and compared bit for bit with the source."""

from __future__ import annotations

import torch

from converter.tools.demo import demo_checkpoint, load_with_torch
from converter.run.sources import open_checkpoint
from test_cli_readable import ckptconv, ckptconv_here


def _keys(path) -> tuple[set[str], set[str]]:
    index = open_checkpoint(path).index()
    return set(index.tensors), set(index.objects)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    return a == b


def _assert_loads_as_source(out, src) -> None:
    """torch's dcp.load of every entry of ``out`` equals the same entry loaded from ``src``."""
    got = load_with_torch(out, open_checkpoint(out).index())
    ref = load_with_torch(src, open_checkpoint(src).index())
    assert all(_same(got[k], ref[k]) for k in got), [k for k in got if not _same(got[k], ref[k])]


def test_model_only_round_trip(dcp_checkpoint, tmp_path):
    src = dcp_checkpoint("fsdp4")
    uni, out = tmp_path / "uni", tmp_path / "out"
    proc = ckptconv("to-universal", str(src), str(uni), "--model-only")
    assert proc.returncode == 0, proc.stderr
    assert "0 objects" in proc.stdout
    tensors, objects = _keys(uni)
    all_t, _ = _keys(src)
    assert tensors == {k for k in all_t if k.startswith("model.")} and not objects
    proc = ckptconv("from-universal", str(uni), str(out), "--mesh", "tp2,dp2", "--plan", "llama")
    assert proc.returncode == 0, proc.stderr
    assert _keys(out) == (tensors, set())
    _assert_loads_as_source(out, src)


def test_model_only_torchtitan_keys(dcp_checkpoint, tmp_path):
    src = dcp_checkpoint("titan_flat")  # model at the top level, flattened optimizer, scheduler, dataloader
    out = tmp_path / "out"
    proc = ckptconv("from-universal", str(src), str(out), "--mesh", "dp3", "--model-only")
    assert proc.returncode == 0, proc.stderr
    tensors, objects = _keys(out)
    assert tensors and not any(k.startswith(("optimizer.", "lr_scheduler", "dataloader", "train_state")) for k in tensors | objects)
    _assert_loads_as_source(out, src)


def test_optim_only_follows_the_parameter_placement(dcp_checkpoint, tmp_path):
    src = dcp_checkpoint("fsdp4")
    full, opt = tmp_path / "full", tmp_path / "opt"
    assert ckptconv("from-universal", str(src), str(full), "--mesh", "tp2,dp2", "--plan", "llama").returncode == 0
    proc = ckptconv("from-universal", str(src), str(opt), "--mesh", "tp2,dp2", "--plan", "llama", "--optim-only")
    assert proc.returncode == 0, proc.stderr
    t_opt, o_opt = _keys(opt)
    assert t_opt and all(k.startswith("optim.") for k in t_opt | o_opt) and o_opt  # states and param groups
    full_index, opt_index = open_checkpoint(full).index(), open_checkpoint(opt).index()
    for key in t_opt:  # sharded exactly as in the full conversion (not replicated)
        assert sorted((c.box.offsets, c.box.sizes) for c in opt_index.tensors[key].chunks) == \
               sorted((c.box.offsets, c.box.sizes) for c in full_index.tensors[key].chunks), key
    assert any(len(opt_index.tensors[k].chunks) == 4 for k in t_opt)
    _assert_loads_as_source(opt, src)


def test_keys_glob_and_regex(tmp_path):
    src = demo_checkpoint()
    uni = tmp_path / "uni"
    proc = ckptconv("to-universal", str(src), str(uni), "--keys", "model.layers.0.*", "--keys", "re:^extra\\.")
    assert proc.returncode == 0, proc.stderr
    tensors, objects = _keys(uni)
    assert tensors == {k for k in _keys(src)[0] if k.startswith("model.layers.0.")}
    assert objects == {k for k in _keys(src)[1] if k.startswith("extra.")}
    out = tmp_path / "out"
    proc = ckptconv("from-universal", str(uni), str(out), "--mesh", "dp2", "--keys", r"re:attention\.w[qk]\.weight$")
    assert proc.returncode == 0, proc.stderr
    assert _keys(out) == ({"model.layers.0.attention.wq.weight", "model.layers.0.attention.wk.weight"}, set())
    _assert_loads_as_source(out, src)


def test_selection_dry_run_counts(tmp_path):
    proc = ckptconv("from-universal", str(demo_checkpoint()), str(tmp_path / "o"), "--mesh", "dp2",
                    "--keys", "model.norm.weight", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "# dry run: 1 tensor, 0 objects" in proc.stdout and not (tmp_path / "o").exists()


def test_selection_matching_nothing_is_an_error(tmp_path):
    src = str(demo_checkpoint())
    for cmd in (["to-universal", src, str(tmp_path / "o")], ["from-universal", src, str(tmp_path / "o"), "--mesh", "dp2"]):
        for extra, needle in ((["--keys", "model.layers.0.attention.wq"], "did you mean 'model.layers.0.attention.wq.weight'"),
                              (["--keys", "re:^nothing"], "no entry matches 're:^nothing'"),
                              (["--keys", "model.*", "--optim-only"], "selects no entry"),
                              (["--model-only", "--optim-only"], "exclude each other")):
            proc = ckptconv_here(*cmd, *extra)
            assert proc.returncode == 2, (cmd, extra, proc)
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("ckptconv: error: ") and needle in lines[0], lines
            assert not (tmp_path / "o").exists()
