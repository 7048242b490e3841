"""``benchmarks/rounding_stages.py`` (bf16 vs fp32 reference, stage by stage) on the small shapes."""

import pytest

from .helpers import load_benchmark


def test_rounding_stages_tiny_cpu():
    pytest.importorskip("transformers", minversion="5.17")
    tool = load_benchmark("rounding_stages")
    seed, _, paths, pairs = tool.measure(tool.parse(["--tiny", "--batch", "4", "--context", "8"]))
    print(f"seed={seed}")
    assert pairs == [("bf16", "fp32")]  # on the CPU: the two references
    rows = {stage: errs[0] for stage, errs in tool.errors(paths, pairs).items() if errs[0] is not None}
    # every stage of the step is there, from the input norms to the logits
    for stage in ("hnorm", "e_proj", "block.attn_hc", "block.self_attn", "block.mlp.gate", "block.mlp.experts",
                  "block.mlp", "block", "hc_head", "norm", "logits"):
        assert stage in rows, (stage, list(rows))
    # bf16 against fp32: a few roundings' worth of error, never zero (the two paths really differ); small
    # up to the router (after it, a near-tie expert choice may flip at some position and move that row)
    before_router = list(rows)[: list(rows).index("block.mlp.gate")]
    for stage, (median, worst) in rows.items():
        assert 1e-5 < median <= worst, (stage, median, worst)
        if stage in before_router:
            assert worst < 2e-2, (stage, worst)
    assert paths["bf16"]["token"].shape == paths["fp32"]["token"].shape == (4,)  # each row's greedy draft
