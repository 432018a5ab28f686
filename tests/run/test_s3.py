"""Object storage: conversions from and to s3:// URLs against a real S3 server on loopback (moto).

The oracle is torch reading the local source (``dcp_to_torch_save``) and our own local outputs:
an S3 output must equal, bit for bit, what torch reads from the local checkpoint (DCP) or the file
bytes the same conversion writes locally (HF safetensors).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_runner import run_cli
from oracle import assert_same_value, torch_reference

SECRET = "Zq9-ckptconv-not-a-real-secret"


def _fs():
    from fsspec.core import url_to_fs

    fs, _ = url_to_fs("s3://x")
    fs.invalidate_cache()
    return fs


def _put(local: Path, url: str) -> None:
    fs = _fs()
    for p in sorted(local.rglob("*")):
        if p.is_file() and p.name not in ("_fixture.json", "_complete.json"):
            fs.put_file(str(p), url[len("s3://"):] + "/" + p.relative_to(local).as_posix())


def _get(url: str, local: Path) -> Path:
    fs = _fs()
    base = url[len("s3://"):]
    for key in fs.find(base):
        dest = local / key[len(base) + 1:]
        dest.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(key, str(dest))
    return local


def _ok(*args: str) -> str:
    code, out, err = run_cli(*args)
    assert code == 0, (args, out, err)
    assert "testing" not in out + err  # the session's secret key never shows
    return out


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "converter", *args], capture_output=True, text=True,
                          env=full, timeout=300)


@pytest.fixture
def s3_source(s3_bucket, dcp_checkpoint):
    src = dcp_checkpoint("fsdp4")
    _put(src, f"{s3_bucket}/src")
    return src, f"{s3_bucket}/src"


def test_s3_to_s3_round_trip_bit_exact(s3_source, s3_bucket, tmp_path):
    local_src, src = s3_source
    uni, out = f"{s3_bucket}/uni", f"{s3_bucket}/out"
    _ok("to-universal", src, uni)
    _ok("from-universal", uni, "--mesh", "dp2", out)
    names = _fs().ls(out[len("s3://"):], detail=False)
    assert any(n.endswith("/.metadata") for n in names)
    got = torch_reference(_get(out, tmp_path / "out"))
    assert_same_value(got, torch_reference(local_src))
    # inspect and verify read the remote store and the remote DCP source in place
    assert "fsdp" in _ok("inspect", src).lower() or _ok("inspect", src)
    _ok("inspect", uni)
    _ok("verify", uni)
    _ok("verify", out)
    # the store records the source as the URL it was given, not as a local path
    meta = json.loads(_fs().cat_file(uni[len("s3://"):] + "/ckptconv.json"))
    assert meta["source"]["path"] == src


def test_safetensors_backend_store_on_s3(s3_source, s3_bucket, tmp_path):
    """A safetensors-backend store written to and read from S3: chunk files uploaded as they are
    final, then inspect, verify and from-universal read it in place (ranged reads)."""
    local_src, src = s3_source
    uni, out = f"{s3_bucket}/unist", f"{s3_bucket}/outst"
    _ok("to-universal", "--backend", "safetensors", "--chunk-size", "64KB", src, uni)
    names = _fs().find(uni[len("s3://"):])
    assert any(n.endswith(".safetensors") for n in names) and not any(n.endswith("zarr.json") for n in names)
    assert "safetensors backend" in _ok("inspect", uni)
    _ok("verify", uni)
    _ok("from-universal", uni, "--mesh", "dp2", out)
    assert_same_value(torch_reference(_get(out, tmp_path / "out")), torch_reference(local_src))
    _ok("to-universal", "--backend", "safetensors", "--chunk-size", "64KB", str(local_src), str(tmp_path / "local"))
    remote = _get(uni, tmp_path / "remote")
    for p in (tmp_path / "local").rglob("*.safetensors"):  # the same bytes as a local conversion
        assert (remote / p.relative_to(tmp_path / "local")).read_bytes() == p.read_bytes()


def test_export_and_import_hf_through_s3(s3_source, s3_bucket, tmp_path):
    local_src, src = s3_source
    _ok("to-universal", str(local_src), str(tmp_path / "uni"))
    _ok("export-hf", str(tmp_path / "uni"), str(tmp_path / "hf"), "--max-shard-size", "200KB")
    _ok("export-hf", str(tmp_path / "uni"), f"{s3_bucket}/hf", "--max-shard-size", "200KB")
    remote = _get(f"{s3_bucket}/hf", tmp_path / "hf_remote")
    local_files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert sorted(p.name for p in remote.iterdir()) == local_files
    for name in local_files:
        assert (remote / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    _ok("import-hf", f"{s3_bucket}/hf", f"{s3_bucket}/uni2")
    _ok("verify", f"{s3_bucket}/uni2")
    _ok("export-hf", f"{s3_bucket}/uni2", str(tmp_path / "hf2"), "--max-shard-size", "200KB")
    for name in local_files:
        if name.endswith(".safetensors"):
            assert (tmp_path / "hf2" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name


def test_remote_destination_rules(s3_source, s3_bucket, tmp_path):
    local_src, src = s3_source
    dst = f"{s3_bucket}/uni"
    _ok("to-universal", str(local_src), dst)
    code, out, err = run_cli("to-universal", str(local_src), dst)
    assert code == 2 and "not empty" in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    code, out, err = run_cli("to-universal", str(local_src), dst, "--resume")
    assert code == 2 and "--resume" in err and "Traceback" not in err
    _ok("to-universal", str(local_src), dst, "--overwrite")
    _ok("verify", dst)
    from formats.storage import RemoteStorage

    other = f"{s3_bucket}/notckpt"
    st = RemoteStorage(other)
    keep = tmp_path / "important.txt"
    keep.write_bytes(b"keep")
    st.put_file(keep, "important.txt")  # not ckptconv's: --overwrite refuses, deletes nothing
    code, out, err = run_cli("to-universal", str(local_src), other, "--overwrite")
    assert code == 2 and "important.txt" in err and "not a ckptconv output" in err, err
    st.refresh()
    assert st.read_bytes("important.txt") == b"keep"
    code, out, err = run_cli("to-universal", src, f"{src}/inner")
    assert code == 2 and "overlaps the source" in err


def test_missing_bucket_key_and_credentials_one_line(s3_bucket):
    for url in ("s3://no-such-bucket-ckptconv/x", f"{s3_bucket}/nothing-here"):
        code, out, err = run_cli("inspect", url)
        assert code == 2, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and url in err
    # no credentials at all (a fresh process: s3fs caches its clients per process)
    env = {k: "" for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    env.update(AWS_SHARED_CREDENTIALS_FILE="/nonexistent", AWS_CONFIG_FILE="/nonexistent",
               AWS_EC2_METADATA_DISABLED="true")
    res = _cli("inspect", f"{s3_bucket}/x", env=env)
    assert res.returncode == 2, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "AWS_ACCESS_KEY_ID" in res.stderr


def test_interrupted_remote_conversion_leaves_no_marker(s3_source, s3_bucket):
    local_src, _ = s3_source
    dst = f"{s3_bucket}/killed"
    res = _cli("to-universal", str(local_src), dst, env={"CKPTCONV_FAULT_KILL_AFTER_BYTES": "1000",
                                                         "AWS_SECRET_ACCESS_KEY": SECRET})
    assert res.returncode == -9
    assert SECRET not in res.stdout + res.stderr
    fs = _fs()
    assert not fs.exists(dst[len("s3://"):] + "/ckptconv.json")
    code, out, err = run_cli("inspect", dst)
    assert code == 2


def test_secret_never_printed(s3_source, s3_bucket):
    local_src, _ = s3_source
    res = _cli("to-universal", str(local_src), f"{s3_bucket}/u", "--progress", env={"AWS_SECRET_ACCESS_KEY": SECRET})
    assert res.returncode == 0, res.stderr
    res = _cli("inspect", f"{s3_bucket}/missing", "--debug", env={"AWS_SECRET_ACCESS_KEY": SECRET})
    assert SECRET not in res.stdout + res.stderr


def test_distcp_without_metadata_is_incomplete(dcp_checkpoint_copy, s3_bucket):
    ckpt = dcp_checkpoint_copy("single")
    (ckpt / ".metadata").unlink()
    for target in (str(ckpt), f"{s3_bucket}/partial"):
        if target.startswith("s3://"):
            _put(ckpt, target)
        code, out, err = run_cli("inspect", target)
        assert code == 2 and "did not finish" in err and ".metadata" in err, err


# ------------------------------------------------------------------------------ streaming uploads

MIB = 1 << 20


def _big_source(path: Path) -> Path:
    """A DCP checkpoint of 8 MiB of float32 plus a bf16 tensor and an object (dcp.save)."""
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(1)
    sd = {"model": {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(8)},
          "extra": {"epoch": 3}}
    sd["model"]["half"] = torch.randn(300, 70, generator=g).to(torch.bfloat16)
    dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    return path


def _tree_size(root: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
            except FileNotFoundError:
                pass
    return total


def _uni_files(root: Path) -> dict[str, bytes]:
    import json

    out = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    meta = json.loads(out.pop("ckptconv.json"))
    meta.pop("created", None)
    out["ckptconv.json"] = json.dumps(meta, sort_keys=True).encode()
    return out


def test_to_universal_streams_uploads_with_a_bounded_spool(s3_bucket, tmp_path, monkeypatch):
    """The spool never holds more than about the memory budget while an 8 MiB store goes up
    (uploads slowed down, so the writer is back-pressured), and the store is bit-exact."""
    import time

    from converter.run import remote
    from converter.config import RunOptions
    from converter.commands.to_universal import to_universal
    from converter.commands.from_universal import from_universal

    src = _big_source(tmp_path / "src")
    spool_base = tmp_path / "spool"
    opts = dict(memory_budget=MIB, workers=2)
    to_universal(src, tmp_path / "local", RunOptions(**opts), chunk_bytes=64 << 10)

    peak = [0]
    real_put = remote._put

    def slow_put(out, st, rel):
        peak[0] = max(peak[0], _tree_size(spool_base))
        time.sleep(0.01)
        return real_put(out, st, rel)

    monkeypatch.setattr(remote, "_put", slow_put)
    dst = f"{s3_bucket}/streamed"
    to_universal(src, dst, RunOptions(spool_dir=str(spool_base), **opts), chunk_bytes=64 << 10)
    local = _uni_files(tmp_path / "local")
    output = sum(len(v) for v in local.values())
    assert output > 8 * MIB
    assert 0 < peak[0] <= 2 * MIB, peak[0]  # vs > 8 MiB of output
    print(f"spool peak {peak[0]} bytes for {output} bytes of output")
    assert _uni_files(_get(dst, tmp_path / "got")) == local  # every file bit-exact
    assert list(spool_base.iterdir()) == []  # the spool is removed
    # the oracle: torch reads the source; the S3 store converted back to DCP holds the same values
    from_universal(dst, tmp_path / "dcp", "dp1")
    assert_same_value(torch_reference(tmp_path / "dcp"), torch_reference(src))


def test_upload_failure_fails_the_run_without_marker(s3_bucket, tmp_path, monkeypatch):
    from converter.run import remote
    from converter.config import RunOptions
    from converter.commands.to_universal import to_universal
    from formats.errors import StorageError

    src = _big_source(tmp_path / "src")
    calls = [0]
    real_put = remote._put

    def failing_put(out, st, rel):
        calls[0] += 1
        if calls[0] == 5:
            raise StorageError(f"{st.root / rel}: storage request failed (SlowDown: injected); check the endpoint")
        return real_put(out, st, rel)

    monkeypatch.setattr(remote, "_put", failing_put)
    dst = f"{s3_bucket}/failed"
    with pytest.raises(StorageError) as err:
        to_universal(src, dst, RunOptions(memory_budget=MIB, workers=2, spool_dir=str(tmp_path / "spool")),
                     chunk_bytes=64 << 10)
    assert "injected" in str(err.value) and len(str(err.value).splitlines()) == 1
    assert calls[0] < 100  # the run stopped early, not after writing everything (~140 files)
    assert not _fs().exists(dst[len("s3://"):] + "/ckptconv.json")
    assert list((tmp_path / "spool").iterdir()) == []


# ------------------------------------------------------------------------------ torchrun to a URL

WORKER = Path(__file__).resolve().parents[1] / "support" / "dist_worker.py"


def _torchrun_worker(nproc: int, out: Path, cmds: list[list[str]]) -> list[dict]:
    import json

    flat: list[str] = []
    for c in cmds:
        flat += [*c, ";;"]
    env = {**os.environ, "CKPTCONV_JOURNAL_FLUSH_SECONDS": "0", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(WORKER), str(out), "--", *flat[:-1]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(Path(f"{out}.{r}").read_text())["results"] for r in range(nproc)]


def test_torchrun_to_s3_bit_identical_and_no_marker_on_failure(s3_bucket, tmp_path):
    """2 gloo ranks each spool and upload their own chunks; rank 0 uploads the metadata and the
    marker after every rank uploaded: the stores equal the single-process local runs bit for bit.
    One rank's failure fails every rank and no marker goes up; DCP/HF outputs are refused."""
    from converter.config import RunOptions
    from converter.commands.export_hf import export_hf
    from converter.commands.import_hf import import_hf
    from converter.commands.to_universal import to_universal

    src = _big_source(tmp_path / "src")
    opts = RunOptions(memory_budget=2 * MIB)
    to_universal(src, tmp_path / "uni", opts, chunk_bytes=256 << 10)
    export_hf(tmp_path / "uni", tmp_path / "hf", max_shard_size="2MB")
    import_hf(tmp_path / "hf", tmp_path / "uni2", options=opts, chunk_bytes=256 << 10)
    b = s3_bucket
    common = ["--chunk-size", "256KiB", "--memory-budget", "2MiB"]
    results = _torchrun_worker(2, tmp_path / "res.json", [
        ["to-universal", *common, str(src), f"{b}/uni"],
        ["import-hf", *common, str(tmp_path / "hf"), f"{b}/uni2"],
        ["from-universal", "--mesh", "dp2", str(tmp_path / "uni"), f"{b}/dcp"],
        ["@fail", "1"],
        ["to-universal", *common, str(src), f"{b}/failed"],
    ])
    for rank_results in results:
        assert [r["ok"] for r in rank_results[:2]] == [True, True], rank_results
        refused, failed = rank_results[2], rank_results[4]
        assert not refused["ok"] and refused["error"] == "ConfigError" and "torchrun" in refused["message"]
        assert not failed["ok"] and "injected failure" in failed["message"], failed
    assert _uni_files(_get(f"{b}/uni", tmp_path / "got")) == _uni_files(tmp_path / "uni")
    assert _uni_files(_get(f"{b}/uni2", tmp_path / "got2")) == _uni_files(tmp_path / "uni2")
    fs = _fs()
    assert not fs.exists(f"{b}/failed/ckptconv.json"[len("s3://"):])
    assert not fs.exists(f"{b}/dcp"[len("s3://"):] + "/.metadata")


def test_spool_without_room_for_a_dcp_output_is_refused(s3_bucket, tmp_path, monkeypatch):
    import collections

    from converter.run import remote

    uni = tmp_path / "uni"
    _ok("to-universal", str(_big_source(tmp_path / "src")), str(uni))
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(remote.shutil, "disk_usage", lambda p: usage(1 << 30, (1 << 30) - MIB, MIB))
    code, out, err = run_cli("from-universal", "--mesh", "dp2", str(uni), f"{s3_bucket}/dcp",
                             "--spool-dir", str(tmp_path / "spool"))
    assert code == 2 and "--spool-dir" in err and "needs" in err and len(err.strip().splitlines()) == 1, err
    assert list((tmp_path / "spool").iterdir()) == []


def test_import_hf_from_s3_reads_the_remote_config_json(s3_bucket, tmp_path):
    """A remote HF directory's config.json is read: tie_word_embeddings recreates lm_head.weight,
    and the torchtitan map gets its head counts from it, as for a local directory."""
    import json

    import torch
    from safetensors.torch import save_file

    from converter.config import RunOptions
    from converter.commands.import_hf import import_hf
    from converter.commands.from_universal import from_universal

    g = torch.Generator().manual_seed(3)
    weights = {"model.embed_tokens.weight": torch.randn(11, 8, generator=g),
               "model.norm.weight": torch.rand(8, generator=g),
               "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g)}
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file(weights, str(hf / "model.safetensors"), metadata={"format": "pt"})
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": True,
                                                "num_attention_heads": 2, "num_key_value_heads": 2}))
    _put(hf, f"{s3_bucket}/hf")
    opts = RunOptions(memory_budget=MIB)
    for key_map in ("identity", "torchtitan-llama"):
        remote = import_hf(f"{s3_bucket}/hf", tmp_path / f"uni-{key_map}", key_map=key_map, options=opts)
        local = import_hf(hf, tmp_path / f"ref-{key_map}", key_map=key_map, options=opts)
        assert remote.warnings and remote.warnings == local.warnings  # lm_head recreated from the embedding
        from_universal(tmp_path / f"uni-{key_map}", tmp_path / f"dcp-{key_map}", "dp1", options=opts)
        from_universal(tmp_path / f"ref-{key_map}", tmp_path / f"dcpref-{key_map}", "dp1", options=opts)
        assert_same_value(torch_reference(tmp_path / f"dcp-{key_map}"), torch_reference(tmp_path / f"dcpref-{key_map}"))
