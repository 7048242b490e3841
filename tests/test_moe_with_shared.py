"""``dsv4_mtp::fp4_moe_with_shared``: the routed FP4 experts plus the shared expert in one op,
the shared expert on a side stream on CUDA.  CPU: the op is the layer's sequential math, bad
shapes are named, hooked or trainable experts keep the module path.  GPU: the overlapped op
equals the sequential one bit for bit, eagerly, compiled and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dsv4_mtp_hf.ops import moe_with_shared
from dsv4_mtp_hf.ops.moe_with_shared import fp4_moe_with_shared, shared_expert

from .helpers import tiny_target_config
from .test_fp4_moe_op import LIMIT, make_experts, make_inputs


def make_shared(D, I, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    w1, w3 = (torch.randn(I, D, device=device, generator=g) * (3 / D**0.5) for _ in range(2))
    w2 = torch.randn(D, I, device=device, generator=g) / I**0.5
    return tuple(w.to(torch.bfloat16) for w in (w1, w3, w2))


def test_op_is_routed_plus_shared_expert_on_cpu():
    E, D, I = 8, 64, 32
    W, S = make_experts(E, D, I, "nvfp4", seed=3), make_shared(D, I, seed=4)
    x, ids, rw = make_inputs(5, E, 3, D, seed=5)
    routed, shared = fp4_moe_with_shared(x, ids, rw, *W, "nvfp4", LIMIT, *S)
    from dsv4_mtp_hf.ops import fp4_moe

    gate, up = nn.functional.linear(x, S[0]), nn.functional.linear(x, S[1])
    act = (nn.functional.silu(gate.float().clamp(max=LIMIT)) * up.float().clamp(-LIMIT, LIMIT)).to(x.dtype)
    assert routed.dtype == shared.dtype == x.dtype
    assert torch.equal(routed, fp4_moe(x, ids, rw, *W, "nvfp4", LIMIT))
    assert torch.equal(shared, nn.functional.linear(act, S[2]))
    assert torch.equal(shared_expert(x, *S, LIMIT), shared)


def test_op_names_bad_shared_expert_shapes():
    E, D, I = 4, 64, 32
    W, (w1, w3, w2) = make_experts(E, D, I, "nvfp4"), make_shared(D, I)
    x, ids, rw = make_inputs(2, E, 2, D)
    with pytest.raises(ValueError, match="shared expert weights"):
        fp4_moe_with_shared(x, ids, rw, *W, "nvfp4", LIMIT, w1, w3[:-1], w2)
    with pytest.raises(ValueError, match="shared expert weights"):
        fp4_moe_with_shared(x, ids, rw, *W, "nvfp4", LIMIT, w1, w3, w2.t().contiguous())
    with pytest.raises(ValueError, match="hidden size"):
        fp4_moe_with_shared(x, ids, rw, *W, "nvfp4", LIMIT, w1[:, :32], w3[:, :32], w2)


def test_layer_takes_the_op_only_for_plain_untrained_experts():
    from dsv4_mtp_hf import DeepseekV4MtpConfig
    from dsv4_mtp_hf.layers.moe import SharedExpert

    s = SharedExpert(DeepseekV4MtpConfig.from_target_config(tiny_target_config())).to(torch.bfloat16)
    x = torch.randn(3, s.gate_proj.in_features, dtype=torch.bfloat16)
    with torch.no_grad():
        assert [w.data_ptr() for w in s.plain_weights(x)] == [
            m.weight.data_ptr() for m in (s.gate_proj, s.up_proj, s.down_proj)]
    assert s.plain_weights(x) is None  # grad enabled and the weights require it: autograd needs the modules
    with torch.no_grad():
        h = s.down_proj.register_forward_hook(lambda *a: None)
        assert s.plain_weights(x) is None  # a hook must still fire
        h.remove()
        s.up_proj.forward = s.up_proj.forward  # an instance-level forward (accelerate's offload hooks)
        assert s.plain_weights(x) is None


def _moe_inputs(T, seed, device="cuda"):
    E, D, I = 16, 4096, 2048  # V4-Flash expert sizes, fewer experts
    W = make_experts(E, D, I, "nvfp4", device=device, seed=seed)
    S = make_shared(D, I, device=device, seed=seed + 1)
    x, ids, rw = make_inputs(T, E, 6, D, device=device, seed=seed + 2)
    return (x, ids.long(), rw, *W, "nvfp4", LIMIT, *S)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 16])
def test_overlapped_op_equals_sequential_on_cuda(T, monkeypatch):
    args = _moe_inputs(T, seed=10 * T)
    out = fp4_moe_with_shared(*args)
    monkeypatch.setattr(moe_with_shared, "use_side_stream", False)
    seq = fp4_moe_with_shared(*args)
    torch.cuda.synchronize()
    for got, want in zip(out, seq):
        assert not torch.isnan(got).any() and got.abs().max() > 0
        assert torch.equal(got, want)  # same kernels, only the launch order differs


def _moe_sum(*args):
    routed, shared = fp4_moe_with_shared(*args)
    return routed + shared  # the layer's add (fused into the next kernel when compiled)


@pytest.mark.gpu
def test_overlapped_op_compiled_and_graph_replayed():
    args = list(_moe_inputs(4, seed=7))
    step = torch.compile(_moe_sum, fullgraph=True)
    want = step(*args)
    out = torch.full_like(want, float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            out.copy_(step(*args))
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(step(*args))
    for seed in (21, 22):  # new inputs into the captured buffers
        new = _moe_inputs(4, seed=seed)
        for dst, src in zip(args[:3], new[:3]):
            dst.copy_(src)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, _moe_sum(*args))
