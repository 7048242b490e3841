"""``dsv4_mtp::mtp_moe`` (router + routed FP4 experts + shared expert, the shared expert on a side
stream on CUDA) and ``dsv4_mtp::clamped_swiglu``.  CPU: the op is the layer's module math, bad
shapes are named, trainable or hooked experts keep the module path.  GPU: the overlapped op
equals the sequential one bit for bit, eagerly, compiled and replayed from a CUDA graph; the
layer's op path matches its module path; the SwiGLU kernel matches the reference."""

from __future__ import annotations

import importlib

import pytest
import torch

from dsv4_mtp_hf import DeepseekV4MtpConfig
from dsv4_mtp_hf.layers.moe import MtpMoE, SharedExpert
from dsv4_mtp_hf.fp8 import decode_block_scale, dequantize_fp8_block, quantize_fp8_block
from dsv4_mtp_hf.ops.fp4_moe import clamped_swiglu, fp4_moe
from dsv4_mtp_hf.ops.moe_route import hash_route_reference
from dsv4_mtp_hf.ops.mtp_moe import clamped_swiglu_op, mtp_moe, shared_expert

from .helpers import randomize_, tiny_target_config
from .test_fp4_moe_op import make_experts

mtp_moe_module = importlib.import_module("dsv4_mtp_hf.ops.mtp_moe")  # the module (the package exports the op)


def make_moe(device="cpu", seed=0, **overrides) -> MtpMoE:
    """A random MtpMoE in bf16: random packed FP4 experts (``make_experts``: codes and scales drawn
    on the device, no CPU quantisation of V4-sized matrices), random dense parts."""
    torch.manual_seed(seed)
    config = DeepseekV4MtpConfig.from_target_config(tiny_target_config(**overrides), expert_format="nvfp4")
    moe = MtpMoE(config)
    randomize_(moe, torch.Generator().manual_seed(seed + 1))
    moe = moe.to(device=device, dtype=torch.bfloat16).eval()
    e = moe.experts
    packed = make_experts(e.num_experts, e.hidden_size, e.intermediate_size, "nvfp4", device=device, seed=seed)
    with torch.no_grad():
        for buf, val in zip((e.w13_weight, e.w13_scale, e.w13_global_bits, e.w2_weight, e.w2_scale, e.w2_global_bits),
                            packed):
            buf.copy_(val.view(torch.int32) if buf.dtype == torch.int32 else val)
        moe.gate.e_score_correction_bias.normal_(0, 0.1)
    return moe


def op_args(moe: MtpMoE, x: torch.Tensor) -> tuple:
    g, e, s = moe.gate, moe.experts, moe.shared_experts
    return (x, g.weight, g.e_score_correction_bias, g.top_k, g.routed_scaling_factor, g.norm_topk_prob,
            e.w13_weight, e.w13_scale, e.w13_global, e.w2_weight, e.w2_scale, e.w2_global, e.format.name,
            e.swiglu_limit, s.gate_proj.weight, s.up_proj.weight, s.down_proj.weight)


@torch.no_grad()
def test_op_is_the_layer_module_math_on_cpu():
    moe = make_moe(seed=3)
    x = torch.randn(5, moe.gate.weight.shape[1], dtype=torch.bfloat16)
    routed, shared = mtp_moe(*op_args(moe, x))
    weights, ids = moe.gate(x)
    assert routed.dtype == shared.dtype == x.dtype
    assert torch.equal(routed, moe.experts(x, weights, ids))
    assert torch.equal(shared, moe.shared_experts(x))
    assert torch.equal(routed + shared, moe(x.unsqueeze(0)).squeeze(0))  # CPU: the layer runs its modules
    s = moe.shared_experts
    assert torch.equal(shared_expert(x, s.gate_proj.weight, s.up_proj.weight, s.down_proj.weight, s.limit), shared)


def target_args(moe: MtpMoE, x: torch.Tensor, seed: int = 0) -> tuple[tuple, tuple]:
    """``mtp_moe``'s arguments as the target's first layers call it -- hash routing (a random token -> experts
    table), an FP8 shared expert (the moe's shared weights quantised as a release stores them) -- and the
    dequantised shared weights ``(w1, w3, w2)``."""
    g = torch.Generator().manual_seed(seed)
    e, s = moe.experts, moe.shared_experts
    tid2eid = torch.randint(0, e.num_experts, (64, moe.gate.top_k), generator=g).to(x.device)
    ids = torch.randint(0, 64, (x.shape[0],), generator=g).to(x.device)
    fp8 = [quantize_fp8_block(m.weight) for m in (s.gate_proj, s.up_proj, s.down_proj)]
    weights, scales = [w for w, _ in fp8], [decode_block_scale(sc).to(x.device) for _, sc in fp8]
    dense = tuple(dequantize_fp8_block(w, sc, x.dtype) for w, sc in zip(weights, scales))
    args = (x, moe.gate.weight, None, moe.gate.top_k, moe.gate.routed_scaling_factor, True, e.w13_weight, e.w13_scale,
            e.w13_global, e.w2_weight, e.w2_scale, e.w2_global, e.format.name, e.swiglu_limit, *weights, *scales,
            tid2eid, ids)
    return args, dense


@torch.no_grad()
def test_op_routes_by_token_id_and_runs_an_fp8_shared_expert_on_cpu():
    """The target's hash-routed layers with a release's FP8 shared expert: the routed half is hash routing + the FP4
    experts, the shared half the expert on the dequantised weights (an e4m3 weight times its power-of-two scale
    is exact in bf16)."""
    moe = make_moe(seed=4)
    x = torch.randn(5, moe.gate.weight.shape[1], dtype=torch.bfloat16)
    args, dense = target_args(moe, x, seed=4)
    routed, shared = mtp_moe(*args)
    weights, ids = hash_route_reference(x, moe.gate.weight, args[-2], args[-1], moe.gate.routed_scaling_factor)
    e = moe.experts
    assert torch.equal(ids, args[-2][args[-1]])
    assert torch.equal(routed, fp4_moe(x, ids, weights, e.w13_weight, e.w13_scale, e.w13_global, e.w2_weight,
                                       e.w2_scale, e.w2_global, e.format.name, e.swiglu_limit))
    torch.testing.assert_close(shared, shared_expert(x, *dense, e.swiglu_limit), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="by score .* or by token id"):
        mtp_moe(*args[:2], moe.gate.e_score_correction_bias, *args[3:])  # a bias and a table
    with pytest.raises(ValueError, match="three block scales"):
        mtp_moe(*args[:17], None, *args[18:])


def test_clamped_swiglu_op_on_cpu():
    gate_up = torch.randn(3, 2, 64) * 8  # some values beyond the limit
    out = clamped_swiglu_op(gate_up.bfloat16(), 10.0)
    assert out.shape == (3, 2, 32) and out.dtype == torch.bfloat16
    assert torch.equal(out, clamped_swiglu(gate_up[..., :32].bfloat16(), gate_up[..., 32:].bfloat16(), 10.0).bfloat16())
    with pytest.raises(ValueError, match="halves of one width"):
        clamped_swiglu_op(torch.randn(2, 5), 10.0)


def test_op_names_bad_shapes():
    moe = make_moe()
    x = torch.randn(2, moe.gate.weight.shape[1], dtype=torch.bfloat16)
    args = list(op_args(moe, x))
    bad = list(args)
    bad[1] = args[1][:, :-1]
    with pytest.raises(ValueError, match="router weight"):
        mtp_moe(*bad)
    bad = list(args)
    bad[15] = args[15][:-1]
    with pytest.raises(ValueError, match="shared expert weights"):
        mtp_moe(*bad)
    bad = list(args)
    bad[16] = args[16].t().contiguous()
    with pytest.raises(ValueError, match="shared expert weights"):
        mtp_moe(*bad)
    bad = list(args)
    bad[0] = x.unsqueeze(0)
    with pytest.raises(ValueError, match=r"\[T, D\]"):
        mtp_moe(*bad)


def test_shared_expert_offers_its_weights_only_when_plain_and_untrained():
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


# V4-Flash expert sizes, fewer experts (the Triton MoE kernels need multiples of 512)
FLASH = dict(hidden_size=4096, moe_intermediate_size=2048, n_routed_experts=16, num_experts_per_tok=6)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 16])
@torch.no_grad()
def test_overlapped_op_equals_sequential_on_cuda(T):
    moe = make_moe("cuda", seed=T, **FLASH)
    seed = 100 + T
    x = torch.randn(T, 4096, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(seed))
    args = op_args(moe, x)
    out = mtp_moe(*args)
    seq = (mtp_moe_module._routed(*args[:14]), shared_expert(x, *args[14:], args[13]))
    torch.cuda.synchronize()
    for got, want in zip(out, seq):
        assert not torch.isnan(got).any() and got.abs().max() > 0
        assert torch.equal(got, want), f"seed={seed}"  # the same kernels, only the launch order differs


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4])
@torch.no_grad()
def test_overlapped_op_with_hash_routing_and_an_fp8_shared_expert_equals_sequential_on_cuda(T):
    moe = make_moe("cuda", seed=T, **FLASH)
    x = torch.randn(T, 4096, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(T))
    args, _ = target_args(moe, x, seed=T)
    out = mtp_moe(*args)
    seq = (mtp_moe_module._routed(*args[:14], *args[20:]), shared_expert(x, *args[14:17], args[13], list(args[17:20])))
    torch.cuda.synchronize()
    for got, want in zip(out, seq):
        assert got.abs().max() > 0 and torch.equal(got, want), f"seed={T}"


@pytest.mark.gpu
@torch.no_grad()
def test_layer_op_path_matches_its_module_path_on_cuda():
    moe = make_moe("cuda", seed=5, **FLASH)
    h = torch.randn(4, 1, 4096, device="cuda", dtype=torch.bfloat16)
    fast = moe(h)
    hook = moe.gate.register_forward_hook(lambda *a: None)  # a hooked router: the modules run
    modules = moe(h)
    hook.remove()
    # the shared SwiGLU is one Triton kernel in the op, PyTorch's kernels in the module: an ulp apart at most
    err = (fast.float() - modules.float()).norm() / modules.float().norm()
    assert err < 1e-2, err


@pytest.mark.gpu
@torch.no_grad()
def test_overlapped_op_compiled_and_graph_replayed():
    moe = make_moe("cuda", seed=7, **FLASH)
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)

    def layer_sum(x):
        routed, shared = mtp_moe(*op_args(moe, x))
        return routed + shared  # the layer's add (fused into the next kernel when compiled)

    step = torch.compile(layer_sum, fullgraph=True)
    out = torch.full_like(x, float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            out.copy_(step(x))
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(step(x))
    for _ in range(2):  # new inputs into the captured buffer
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, layer_sum(x))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,i", [(1, 2048), (16, 2048), (3, 1000)])
def test_swiglu_kernel_matches_reference(rows, i):
    gate_up = (torch.randn(rows, 2 * i, device="cuda") * 8).bfloat16()  # a few per cent beyond the limit
    gate_up[0, 0] = float("nan")
    got = clamped_swiglu_op(gate_up, 10.0)
    want = clamped_swiglu(gate_up[:, :i], gate_up[:, i:], 10.0)
    assert got.dtype == torch.bfloat16 and torch.isnan(got[0, 0])
    torch.testing.assert_close(got[:, 1:].float(), want[:, 1:], rtol=8e-3, atol=1e-5)
