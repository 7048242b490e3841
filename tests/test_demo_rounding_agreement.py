"""``benchmarks/demo_rounding_agreement.py`` (bf16 vs fp32 MTP drafts on the trained demo pair) on a few windows."""

from .helpers import load_benchmark


def test_demo_rounding_agreement_on_held_out_text():
    tool = load_benchmark("demo_rounding_agreement")
    r = tool.agreement(tool.parse(["--rounds", "2", "--batch", "4", "--context", "48", "--seed", "7"]))
    # every window counts its first draft; a trained model's two roundings agree almost everywhere
    assert 8 <= r["counted"] <= 24 and r["same"] >= r["counted"] - 2, r
    assert float(r["gaps"].median()) > 0 and r["logits_rms"] > 0, r


def test_windows_come_from_the_held_out_modules():
    import torch

    tool = load_benchmark("demo_rounding_agreement")
    streams = [torch.arange(10), torch.arange(100, 130)]
    w = tool.windows(streams, 6, 8, torch.Generator().manual_seed(0))
    assert w.shape == (6, 8)
    for row in w:  # a contiguous slice of one stream
        assert bool((row[1:] - row[:-1] == 1).all()) and (int(row[0]) + 7 < 10 or 100 <= int(row[0]) <= 122)
