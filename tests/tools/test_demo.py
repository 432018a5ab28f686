"""The bundled demo runs end to end and checks its outputs with torch's own dcp.load."""

from __future__ import annotations

from converter.tools.demo import demo_checkpoint, run_demo


def test_demo_pipeline(tmp_path, capsys):
    assert (demo_checkpoint() / ".metadata").is_file()
    run_demo(str(tmp_path))  # raises when any converted entry differs from the source
    out = capsys.readouterr().out
    assert out.count("bit-identical to the source") == 2
    assert (tmp_path / "uni" / "ckptconv.json").is_file()
    assert (tmp_path / "out-tp2-dp2" / ".metadata").is_file()
