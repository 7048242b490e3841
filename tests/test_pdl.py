"""Programmatic dependent launch (``ops/triton/pdl.py``): the launch arguments, and (``-m gpu``) a
chain of the package's kernels replayed from a CUDA graph with PDL edges, giving the bits of the
eager calls while each kernel reads what the one before it just wrote."""

from __future__ import annotations

import importlib.util

import pytest
import torch

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
SEED = 0


@needs_triton
def test_launch_args_keep_the_constexpr_and_the_launch_flag_together():
    from dsv4_mtp_hf.ops import inductor_options
    from dsv4_mtp_hf.ops.triton import pdl

    assert pdl.launch_args(torch.device("cpu")) == {"PDL": 0}  # never "launch_pdl" without "PDL"
    assert inductor_options(torch.device("cpu")) == {}
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        assert pdl.launch_args(torch.device("cuda")) == {"PDL": 1, "launch_pdl": True}


def _chain(x, w1, w3, w2, head):
    """skinny gate/up -> SwiGLU -> skinny down -> add -> skinny lm-head-like -> argmax: each kernel
    reads the previous one's output (the draft step's dependency pattern)."""
    from dsv4_mtp_hf.ops import argmax_last
    from dsv4_mtp_hf.ops.mtp_moe import shared_expert
    from dsv4_mtp_hf.ops.skinny_linear import skinny_linear

    h = shared_expert(x, w1, w3, w2, 10.0)
    logits = skinny_linear(h, head)
    return logits, argmax_last(logits)


@pytest.mark.gpu
def test_pdl_chain_graph_replays_equal_eager_calls():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    print(f"seed={SEED}")
    g = torch.Generator(device="cuda").manual_seed(SEED)
    d, i, v = 4096, 2048, 32768

    def rnd(*shape, scale):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).bfloat16()

    x, w1, w3 = rnd(1, d, scale=1.0), rnd(i, d, scale=3 / d**0.5), rnd(i, d, scale=3 / d**0.5)
    w2, head = rnd(d, i, scale=1 / i**0.5), rnd(v, d, scale=1 / d**0.5)
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            _chain(x, w1, w3, w2, head)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_l, out_t = _chain(x, w1, w3, w2, head)
        for _ in range(10):  # fresh inputs each replay: a kernel that ran early would read stale values
            x.copy_(rnd(1, d, scale=1.0))
            want_l, want_t = _chain(x, w1, w3, w2, head)
            torch.cuda.synchronize()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out_l, want_l) and torch.equal(out_t, want_t), f"seed={SEED}"
