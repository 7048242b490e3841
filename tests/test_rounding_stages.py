"""``benchmarks/rounding_stages.py`` (bf16 vs fp32 reference, stage by stage) on the small shapes."""

import re

import pytest

from .helpers import load_benchmark


def test_rounding_stages_tiny_cpu(capsys):
    pytest.importorskip("transformers", minversion="5.17")
    load_benchmark("rounding_stages").main(["--tiny", "--batch", "4", "--context", "8"])
    out = capsys.readouterr().out
    rows = {m.group(1): (float(m.group(2)), float(m.group(3)))
            for m in re.finditer(r"^(\S+)\s+\([\d, ]+\)\s+\S+\s+(\S+)\s+(\S+)\s*$", out, re.M)}
    # every stage of the step is there, from the input norms to the logits
    for stage in ("hnorm", "e_proj", "block.attn_hc", "block.self_attn", "block.mlp.gate", "block.mlp.experts",
                  "block.mlp", "block", "hc_head", "norm", "logits"):
        assert stage in rows, (stage, out)
    # bf16 against fp32: a few roundings' worth of error, never zero (the two paths really differ); small
    # up to the router (after it, a near-tie expert choice may flip at some position and move that row)
    before_router = list(rows)[: list(rows).index("block.mlp.gate")]
    for stage, (median, worst) in rows.items():
        assert 1e-5 < median <= worst, (stage, median, worst)
        if stage in before_router:
            assert worst < 2e-2, (stage, worst)
    assert re.search(r"same greedy token: bf16 vs fp32 \d+/4", out)
