"""``benchmarks/demo_rounding_agreement.py`` (bf16 vs fp32 MTP drafts on the trained demo pair) on a few windows."""

import re

from .helpers import load_benchmark


def test_demo_rounding_agreement_on_held_out_text(capsys):
    tool = load_benchmark("demo_rounding_agreement")
    tool.main(["--rounds", "2", "--batch", "4", "--context", "48", "--seed", "7"])
    out = capsys.readouterr().out
    m = re.search(r"same greedy draft at (\d+)/(\d+) positions", out)
    assert m, out
    same, counted = int(m.group(1)), int(m.group(2))
    # every window counts its first draft; a trained model's two roundings agree almost everywhere
    assert 8 <= counted <= 24 and same >= counted - 2, out
    gaps = re.search(r"median (\S+); logits rms (\S+)", out)
    assert gaps and float(gaps.group(1)) > 0 and float(gaps.group(2)) > 0, out


def test_windows_come_from_the_held_out_modules():
    import torch

    tool = load_benchmark("demo_rounding_agreement")
    streams = [torch.arange(10), torch.arange(100, 130)]
    w = tool.windows(streams, 6, 8, torch.Generator().manual_seed(0))
    assert w.shape == (6, 8)
    for row in w:  # a contiguous slice of one stream
        assert bool((row[1:] - row[:-1] == 1).all()) and (int(row[0]) + 7 < 10 or 100 <= int(row[0]) <= 122)
