"""`python -m dsv4_mtp_hf.demo` on the embedded pair and on checkpoints given by path."""

import pytest

from dsv4_mtp_hf import demo, load_demo_pair


def test_demo_runs_on_the_embedded_pair_and_prints_the_table(capsys):
    assert demo.main(["--device", "cpu", "--max-new-tokens", "12", "--repeats", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "speedup" in out and "accepted len" in out and "acceptance by draft position" in out
    all_row = next(line for line in out.splitlines() if line.split()[:1] == ["all"])
    assert all_row.split()[-1] == "True"  # the `all` row: outputs identical
    assert "Columns:" in out and "threads=1" in out  # the legend; one torch thread by default


def test_demo_loads_any_target_and_mtp_by_path(tmp_path, capsys):
    target, mtp, tokenizer = load_demo_pair()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    mtp.save_pretrained(tmp_path / "mtp")
    argv = ["--device", "cpu", "--dtype", "float32", "--max-new-tokens", "8", "--repeats", "1", "--quiet",
            "--num-assistant-tokens", "2", "--target", str(tmp_path / "target"), "--mtp", str(tmp_path / "mtp"),
            "--prompt", "def f(x):\n    return"]
    assert demo.main(argv) == 0
    assert "K=2" in capsys.readouterr().out


def test_demo_rejects_bad_options():
    with pytest.raises(SystemExit):
        demo.main(["--num-assistant-tokens", "0"])
    with pytest.raises(SystemExit):
        demo.main(["--mtp", "somewhere"])
