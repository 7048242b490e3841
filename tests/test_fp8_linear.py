"""FP8 projections kept as the release stores them (issue 49): ``dsv4_mtp::fp8_linear`` against a
block-by-block dequantisation, transformers' FP8 modules swapped for ours when a native release is loaded as on a
GPU (transformers' quantizer active), and (``-m gpu``) the Triton kernel against the reference."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV4ForCausalLM

from dsv4_mtp_hf import graph_target, pack_fp4_experts
from dsv4_mtp_hf.fp8 import quantize_fp8_block
from dsv4_mtp_hf.layers.linear import project
from dsv4_mtp_hf.ops.fp8_linear import (fp8_linear, fp8_linear_cat_op, fp8_linear_cat_reference, fp8_linear_op,
                                       fp8_linear_reference)
from dsv4_mtp_hf.target_runtime.experts import DeepseekV4PackedExpertsForCausalLM
from dsv4_mtp_hf.target_runtime.fp8_linears import FP8BlockLinear, fp8_linear_bytes, quantize_fp8_linears

from .helpers import tiny_pair
from .test_target_experts import logits, packed_experts, set_dense, whole_release

SEED = 49
# The native names of what a V4 release stores in FP8 (the compressors' projections and the indexer's
# weights_proj are BF16 there)
RELEASE_FP8 = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
               "indexer.wq_b.weight", "shared_experts.w1.weight", "shared_experts.w2.weight", "shared_experts.w3.weight")


@pytest.mark.parametrize("m,n,k,groups", [(1, 256, 512, 1), (3, 200, 300, 1), (5, 512, 128, 4), (70, 384, 96, 2)])
def test_reference_is_the_linear_of_the_dequantised_weight(m, n, k, groups):
    print(f"seed={SEED}")
    gen = torch.Generator().manual_seed(SEED)
    q, s = quantize_fp8_block(torch.randn(n, k, generator=gen))
    x = torch.randn(m, groups * k, generator=gen)
    w = q.float()  # each 128x128 block times its own scale, one block at a time
    for i in range(0, n, 128):
        for j in range(0, k, 128):
            w[i:i + 128, j:j + 128] *= s.float()[i // 128, j // 128]
    want = torch.cat([x[:, g * k:(g + 1) * k] @ w[g * n // groups:(g + 1) * n // groups].T for g in range(groups)], -1)
    got = fp8_linear(x.view(m, 1, -1), q, s.float(), groups)
    assert got.shape == (m, 1, n)
    torch.testing.assert_close(got.view(m, n), want, rtol=1e-5, atol=1e-5)


def test_bad_inputs_name_the_problem():
    q, s = quantize_fp8_block(torch.randn(256, 256))
    x = torch.randn(2, 256)
    with pytest.raises(TypeError, match="scale must be float32"):
        fp8_linear_op(x, q, s)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8_linear_op(x, q.float(), s.float())
    with pytest.raises(ValueError, match=r"scale of shape \(2, 2\)"):
        fp8_linear_op(x, q, s.float()[:1])
    with pytest.raises(ValueError, match="does not match weight"):
        fp8_linear_op(torch.randn(2, 128), q, s.float())
    with pytest.raises(TypeError, match="2-D float8_e4m3fn"):
        FP8BlockLinear(q.float(), s)


def test_fp8_linear_cat_is_each_projection_and_project_pairs_fp8_modules():
    """``fp8_linear_cat`` equals each weight's ``fp8_linear`` side by side; ``project`` runs FP8 block modules two
    to an op beside plain linears and gives each module what calling it gives; bad inputs name the problem."""
    print(f"seed={SEED}")
    gen = torch.Generator().manual_seed(SEED)
    mods = [FP8BlockLinear(*quantize_fp8_block(torch.randn(n, 256, generator=gen))) for n in (200, 128, 64)]
    plain = torch.nn.Linear(256, 48, bias=False)
    x = torch.randn(2, 3, 256, generator=gen)
    got = fp8_linear_cat_op(x.view(6, 256), [m.weight for m in mods[:2]], [m.weight_scale_inv for m in mods[:2]])
    torch.testing.assert_close(got, torch.cat([m(x.view(6, 256)) for m in mods[:2]], -1), rtol=0, atol=0)
    torch.library.opcheck(fp8_linear_cat_op, (x.view(6, 256), [m.weight for m in mods[:2]],
                                              [m.weight_scale_inv for m in mods[:2]]),
                            test_utils=("test_faketensor", "test_aot_dispatch_static"))  # schema mode: no CPU fp8 mul
    for y, m in zip(project(x, mods[0], plain, mods[1], mods[2]), (mods[0], plain, mods[1], mods[2])):
        torch.testing.assert_close(y, m(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="one scale per weight"):
        fp8_linear_cat_op(x.view(6, 256), [mods[0].weight], [])
    with pytest.raises(ValueError, match="does not match weight"):
        fp8_linear_cat_op(x.view(6, 256)[:, :128], [m.weight for m in mods[:2]], [m.weight_scale_inv for m in mods[:2]])


def native_fp8_release(path, target, experts, seed):
    """``target`` written as a native release: the projections above in FP8 e4m3 with random E8M0 block scales,
    MXFP4 experts, the release's quantization_config and ``expert_dtype``."""
    release = whole_release(path, target, experts, "native_fp8_mxfp4")
    tensors = load_file(str(release / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    for key in [k for k in tensors if k.endswith(RELEASE_FP8) and not k.startswith("mtp.")]:
        w = tensors[key]
        tensors[key] = w.float().to(torch.float8_e4m3fn)
        blocks = (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
        tensors[key.removesuffix("weight") + "scale"] = torch.randint(
            125, 129, blocks, generator=gen, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    save_file(tensors, str(release / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((release / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                     "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    config["expert_dtype"] = "fp4"
    (release / "config.json").write_text(json.dumps(config))
    return release


@pytest.mark.tf_internals
@pytest.mark.parametrize("load", ["packed_class", "auto_then_pack"])
def test_a_native_release_loaded_as_on_a_gpu_runs_fp8_projections_and_equals_the_dequantised_load(
        tmp_path, monkeypatch, load):
    """On a GPU transformers' quantizer makes the projections FP8Linear and the experts FP8Experts.  Both ways to a
    fast target (the packed class, or transformers' model then pack_fp4_experts) end with our FP8 modules on the
    release's bytes and packed experts, and compute what transformers' dequantised load computes."""
    print(f"seed={SEED}")
    target, mtp = tiny_pair(seed=SEED)
    experts = packed_experts(target.config, "mxfp4", SEED)
    set_dense(target, experts, "mxfp4")
    release = native_fp8_release(tmp_path / "native", target, experts, SEED)
    want = logits(DeepseekV4ForCausalLM.from_pretrained(release))  # on a CPU: dequantised by transformers
    force_quantizer(monkeypatch)
    if load == "packed_class":
        model = DeepseekV4PackedExpertsForCausalLM.from_pretrained(release).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(release).eval()
        assert any(type(m).__name__ == "FP8Linear" for m in model.modules())  # transformers' own, as on a GPU
        pack_fp4_experts(model, release)
    kinds = {type(m).__name__ for m in model.modules()}
    assert "FP8BlockLinear" in kinds and not kinds & {"FP8Linear", "FP8GroupedLinear"}
    swapped = [n for n, m in model.named_modules() if isinstance(m, FP8BlockLinear)]
    assert any(n.endswith("o_a_proj") for n in swapped) and any(n.endswith("indexer.q_b_proj") for n in swapped)
    assert not [n for n, _ in model.named_parameters() if ".mlp.experts." in n and ".fp4." not in n]
    torch.testing.assert_close(logits(model), want, rtol=1e-4, atol=1e-4)
    mtp.bind(model)
    ids = torch.randint(3, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(SEED))
    plain = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=mtp), plain)


@pytest.mark.tf_internals
def test_quantised_projections_halve_their_bytes_and_the_graphed_target_stays_exact():
    """quantize_fp8_linears on a bf16-shaped target: each listed projection becomes FP8 + block scales (the
    release's recipe), the model equals one whose weights hold the dequantised values, and greedy assisted
    generate on the graphed target equals plain."""
    print(f"seed={SEED}")
    target, mtp = tiny_pair(seed=SEED)
    before = sum(m.weight.nbytes for n, m in target.named_modules() if isinstance(m, torch.nn.Linear)
                 and n.endswith(("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj")) and "compressor.k" not in n)
    names = quantize_fp8_linears(target)
    assert names and not any(".compressor.kv_proj" in n or "gate_proj" in n and "compressor" in n for n in names)
    assert fp8_linear_bytes(target) < before / 3  # fp32 here: a quarter, plus the scales
    dense, _ = tiny_pair(seed=SEED)
    with torch.no_grad():
        for name in names:
            fp8 = target.get_submodule(name)
            dense.get_submodule(name).weight.copy_(fp8_linear_reference(
                torch.eye(fp8.weight.shape[1]), fp8.weight, fp8.weight_scale_inv).T)
    torch.testing.assert_close(logits(target), logits(dense), rtol=1e-4, atol=1e-4)
    pack_fp4_experts(target)
    graph_target(target, max_length=64, max_rollback=3)
    mtp.bind(target)
    ids = torch.randint(3, target.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(SEED))
    plain = target.generate(ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=mtp), plain)


def force_quantizer(monkeypatch):
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *a, **k: None)


@pytest.mark.tf_internals
def test_fp8_projections_save_and_load_back_on_a_cpu_and_as_on_a_gpu(tmp_path, monkeypatch):
    """A packed target with FP8 projections saves them with their scales under transformers' FineGrainedFP8
    config: a CPU reload dequantises them, a GPU-like reload keeps them FP8; both compute what was saved.
    Before, the reload read the FP8 bytes without their scales into plain linears."""
    print(f"seed={SEED}")
    target, _ = tiny_pair(seed=SEED)
    quantize_fp8_linears(target)
    pack_fp4_experts(target)
    want = logits(target)
    target.save_pretrained(tmp_path / "fp8")
    cpu = DeepseekV4PackedExpertsForCausalLM.from_pretrained(tmp_path / "fp8")
    torch.testing.assert_close(logits(cpu), want, rtol=1e-5, atol=1e-5)
    force_quantizer(monkeypatch)
    gpu_like = DeepseekV4PackedExpertsForCausalLM.from_pretrained(tmp_path / "fp8")
    assert {n for n, m in gpu_like.named_modules() if isinstance(m, FP8BlockLinear)} == {
        n for n, m in target.named_modules() if isinstance(m, FP8BlockLinear)}
    torch.testing.assert_close(logits(gpu_like), want, rtol=1e-5, atol=1e-5)
    gpu_like.save_pretrained(tmp_path / "again")  # a model loaded under the quantizer saves too
    torch.testing.assert_close(logits(DeepseekV4PackedExpertsForCausalLM.from_pretrained(tmp_path / "again")),
                               want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 16, 33, 64, 100])
def test_cuda_kernel_matches_the_reference_on_v4_flash_shapes(rows):
    """The Triton W8A16 kernel (and the reference beyond 64 rows) on V4-Flash's FP8 projections, bf16."""
    print(f"seed={SEED}")
    gen = torch.Generator().manual_seed(SEED)
    shapes = [(1024, 4096, 1), (32768, 1024, 1), (512, 4096, 1), (8192, 4096, 8), (4096, 8192, 1), (2048, 4096, 1),
              (4096, 2048, 1), (8192, 1024, 1), (200, 300, 1)]
    for n, k, groups in shapes:
        q, s = quantize_fp8_block(torch.randn(n, k, generator=gen) * 0.02)
        x = torch.randn(rows, groups * k, generator=gen).bfloat16()
        q, s, x = q.cuda(), s.float().cuda(), x.cuda()
        want = fp8_linear_reference(x.float(), q, s, groups)
        got = fp8_linear_op(x, q, s, groups).float()
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 1e-2, f"N={n} K={k} groups={groups} rows={rows}: relative error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_cuda_cat_kernel_matches_the_reference_on_v4_flash_pairs(rows):
    """Two FP8 weights that read one input in one launch (q_a + kv, q_b + the indexer's q_b, the shared expert's
    gate + up), and an odd pair whose widths are not whole tiles."""
    print(f"seed={SEED}")
    gen = torch.Generator().manual_seed(SEED)
    for (n0, n1), k in [((1024, 512), 4096), ((32768, 8192), 1024), ((2048, 2048), 4096), ((200, 72), 300)]:
        ws = [quantize_fp8_block(torch.randn(n, k, generator=gen) * 0.02) for n in (n0, n1)]
        q, s = [w.cuda() for w, _ in ws], [sc.float().cuda() for _, sc in ws]
        x = torch.randn(rows, k, generator=gen).bfloat16().cuda()
        want = fp8_linear_cat_reference(x.float(), q, s)
        got = fp8_linear_cat_op(x, q, s).float()
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 1e-2, f"N={n0}+{n1} K={k} rows={rows}: relative error {err:.3g}"


@pytest.mark.gpu
def test_cuda_kernel_replays_in_a_graph():
    gen = torch.Generator().manual_seed(SEED)
    q, s = quantize_fp8_block(torch.randn(4096, 4096, generator=gen))
    q, s = q.cuda(), s.float().cuda()
    x = torch.randn(1, 4096, generator=gen).bfloat16().cuda()
    fp8_linear_op(x, q, s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear_op(x, q, s)
    x.copy_(torch.randn(1, 4096, generator=gen).bfloat16())
    graph.replay()
    torch.testing.assert_close(out.float(), fp8_linear_reference(x.float(), q, s), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_graphed_cuda_target_with_fp8_projections_stays_exact_with_the_mtp():
    """FP8 projections on the compiled, captured target (the W8A16 kernel inside CUDA graphs): assisted greedy
    generate equals plain greedy on the same graphed target."""
    print(f"seed={SEED}")
    target, mtp = tiny_pair(seed=SEED, target_overrides=dict(hidden_size=256, moe_intermediate_size=256,
                                                             n_routed_experts=16, num_experts_per_tok=4))
    target, mtp = target.to("cuda", torch.bfloat16), mtp.to("cuda")  # as tests/test_target_graph.py's GPU target
    assert quantize_fp8_linears(target)
    pack_fp4_experts(target)
    graph_target(target, max_length=96, max_rollback=3)
    mtp.bind(target)
    ids = torch.randint(3, target.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(SEED)).cuda()
    kw = dict(max_new_tokens=48, do_sample=False, eos_token_id=None)
    plain = target.generate(ids, **kw)
    assert torch.equal(target.generate(ids, assistant_model=mtp, num_assistant_tokens=3, **kw), plain)
