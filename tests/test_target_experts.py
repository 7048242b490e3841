"""Packed FP4 routed experts for transformers' V4 target (`pack_fp4_experts`, issue 31).

The oracle is transformers' own target with its experts holding exactly the values the packed
bytes encode (what its loader produces from a release).  Releases are written in the native
layouts with the native tensor names."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4ForCausalLM

from dsv4_mtp_hf import fp4, pack_fp4_experts
from dsv4_mtp_hf.loading import MtpCheckpointError
from dsv4_mtp_hf.target_runtime.experts import DeepseekV4PackedExpertsForCausalLM, expert_bytes

from .helpers import randomize_, tiny_pair, tiny_target_config
from .test_loading import packed_expert_tensors

SEED = 31


def packed_experts(config, fmt: str, seed: int):
    """Random packed experts per layer: {layer: (w13, w13_scale, g13 [E, 2], w2, w2_scale, g2 [E])}."""
    g = torch.Generator().manual_seed(seed)
    e, d, i, grp = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size, fp4.get_format(fmt).group_size
    lo, hi = (118, 124) if fmt == "mxfp4" else (40, 56)  # E8M0 ~2^-7..2^-4 / E4M3 ~0.02..0.1
    out = {}
    for layer in range(config.num_hidden_layers):
        def scales(*shape):
            return torch.randint(lo, hi, shape, generator=g, dtype=torch.uint8)

        glob = (lambda *s: torch.rand(*s, generator=g) + 0.5) if fmt == "nvfp4" else (lambda *s: torch.ones(*s))
        out[layer] = (torch.randint(0, 256, (e, 2 * i, d // 2), generator=g, dtype=torch.uint8), scales(e, 2 * i, d // grp),
                      glob(e, 2), torch.randint(0, 256, (e, d, i // 2), generator=g, dtype=torch.uint8),
                      scales(e, d, i // grp), glob(e))
    return out


@torch.no_grad()
def set_dense(target, experts: dict, fmt: str) -> None:
    """transformers' experts = the values the packed bytes encode."""
    i = target.config.moe_intermediate_size
    for layer, (w13, s13, g13, w2, s2, g2) in experts.items():
        ex = target.model.layers[layer].mlp.experts
        dense13 = fp4.dequantize_fp4(w13, s13, fmt)
        dense13[:, :i] *= g13[:, 0, None, None]
        dense13[:, i:] *= g13[:, 1, None, None]
        ex.gate_up_proj.copy_(dense13)
        ex.down_proj.copy_(fp4.dequantize_fp4(w2, s2, fmt, g2))


def release_expert_tensors(experts: dict, inter: int, layout: str) -> dict:
    """Every routed expert matrix of ``experts`` under the release's names, in ``layout``."""
    tensors = {}
    for layer, (w13, s13, g13, w2, s2, g2) in experts.items():
        for e in range(w13.shape[0]):
            for m, p, s, gl in (("w1", w13[e, :inter], s13[e, :inter], g13[e, 0]),
                                ("w3", w13[e, inter:], s13[e, inter:], g13[e, 1]), ("w2", w2[e], s2[e], g2[e])):
                tensors.update(packed_expert_tensors(f"layers.{layer}.ffn.experts.{e}.{m}", p, s, gl, layout))
    return tensors


def write_release(path, config, experts: dict, layout: str, skip=None, config_extra=None):
    tensors = {"embed.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
               **release_expert_tensors(experts, config.moe_intermediate_size, layout)}
    if skip:
        tensors.pop(skip)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**config.to_dict(), **(config_extra or {})}))
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for k, v in tensors.items():  # layer 0 in the first shard, the rest in the second
        shards["model-00001-of-00002.safetensors" if ".0.ffn" in k or k == "embed.weight"
               else "model-00002-of-00002.safetensors"][k] = v.contiguous()
    weight_map = {}
    for name, part in shards.items():
        save_file(part, str(path / name))
        weight_map.update(dict.fromkeys(part, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def logits(target, seed: int = SEED):
    ids = torch.randint(3, target.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return target(ids.to(target.device)).logits


FORMAT = {"native_fp8_mxfp4": "mxfp4", "modelopt_nvfp4": "nvfp4", "compressed_tensors_nvfp4": "nvfp4"}


@pytest.mark.parametrize("layout", sorted(FORMAT))
def test_release_experts_load_bit_exact_and_match_transformers_dense_target(tmp_path, layout):
    print(f"seed={SEED}")
    target, _ = tiny_pair(seed=SEED)
    experts = packed_experts(target.config, FORMAT[layout], SEED)
    set_dense(target, experts, FORMAT[layout])
    want = logits(target)
    bf16_bytes = sum(t.numel() * 2 for layer in target.model.layers
                     for t in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj))
    pack_fp4_experts(target, write_release(tmp_path / layout, target.config, experts, layout))
    assert target.config._experts_implementation == "dsv4_fp4"
    for layer, (w13, s13, g13, w2, s2, g2) in experts.items():
        ex = target.model.layers[layer].mlp.experts
        assert not hasattr(ex, "gate_up_proj") and not hasattr(ex, "down_proj")  # the dense copies are gone
        p = ex.fp4
        assert p.format.name == FORMAT[layout]
        for got, ref in ((p.w13_weight, w13), (p.w13_scale, s13), (p.w2_weight, w2), (p.w2_scale, s2)):
            assert torch.equal(got, ref)
        torch.testing.assert_close(p.w13_global, g13, rtol=1e-6, atol=0)  # compressed-tensors: 1 / (1 / g)
        torch.testing.assert_close(p.w2_global, g2, rtol=1e-6, atol=0)
    torch.testing.assert_close(logits(target), want, rtol=1e-4, atol=1e-4)
    assert expert_bytes(target) <= 0.3 * bf16_bytes  # packed vs the bf16 experts transformers would hold


def test_packing_in_memory_mxfp4_experts_is_exact_and_assisted_generate_stays_equal(capsys):
    print(f"seed={SEED}")
    target, mtp = tiny_pair(seed=SEED + 1)
    set_dense(target, packed_experts(target.config, "mxfp4", SEED + 1), "mxfp4")
    want = logits(target)
    ids = torch.randint(3, target.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(SEED))
    plain_dense = target.generate(ids, max_new_tokens=16, do_sample=False)
    pack_fp4_experts(target)  # re-quantises the dense values: MXFP4 values come back exactly
    assert "packing routed experts (mxfp4)" in capsys.readouterr().err  # a progress bar, one step a layer
    torch.testing.assert_close(logits(target), want, rtol=1e-4, atol=1e-4)
    plain = target.generate(ids, max_new_tokens=16, do_sample=False)
    assisted = target.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=mtp, num_assistant_tokens=3)
    assert torch.equal(plain, plain_dense)
    assert torch.equal(assisted, plain)
    assert mtp.last_generation_stats.rounds > 0


def whole_release(path, target, experts: dict, layout: str):
    """``target`` saved by transformers under the release's names (no ``model.`` prefix), its routed experts
    in ``layout`` ("dense": the bf16 tensors transformers writes, holding the packed values)."""
    target.save_pretrained(path)
    tensors = {k.removeprefix("model."): v for k, v in load_file(str(path / "model.safetensors")).items()}
    if layout != "dense":
        tensors = {k: v for k, v in tensors.items() if ".ffn.experts." not in k}
        tensors.update(release_expert_tensors(experts, target.config.moe_intermediate_size, layout))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.mark.tf_internals
@pytest.mark.parametrize("layout", ["dense", *sorted(FORMAT)])
def test_loading_a_release_packed_never_builds_bf16_experts(tmp_path, layout):
    """`DeepseekV4PackedExpertsForCausalLM.from_pretrained`: transformers' loader for everything but the
    routed experts, which are read packed from the release; the model equals transformers' dense target."""
    print(f"seed={SEED}")
    fmt = FORMAT.get(layout, "mxfp4")
    target, mtp = tiny_pair(seed=SEED)
    experts = packed_experts(target.config, fmt, SEED)
    set_dense(target, experts, fmt)
    want = logits(target)
    release = whole_release(tmp_path / layout, target, experts, layout)
    model = DeepseekV4PackedExpertsForCausalLM.from_pretrained(release).eval()
    dense = [n for n, _ in model.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert not dense  # never allocated
    assert model.config._experts_implementation == "dsv4_fp4"
    assert model.model.layers[1].mlp.experts.fp4.format.name == fmt
    assert expert_bytes(model) < expert_bytes(target) / 3
    torch.testing.assert_close(logits(model), want, rtol=1e-4, atol=1e-4)
    mtp.bind(model)
    ids = torch.randint(3, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(SEED))
    plain = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=mtp), plain)


FP8_WEIGHTS = (".attn.wq_a.weight", ".attn.wq_b.weight", ".attn.wkv.weight", ".attn.wo_b.weight",
               ".shared_experts.w1.weight", ".shared_experts.w2.weight", ".shared_experts.w3.weight")


@pytest.mark.tf_internals
def test_loading_packed_a_native_release_with_fp8_weights_equals_transformers_own_load(tmp_path):
    """The native layout whole: FP8 e4m3 projections with E8M0 block scales under the release's
    `quantization_config` (on CPU transformers' FP8 quantizer dequantises them), MXFP4 experts.  The oracle is
    transformers' own `from_pretrained` of the same files, experts widened to dense."""
    print(f"seed={SEED}")
    target, _ = tiny_pair(seed=SEED)
    experts = packed_experts(target.config, "mxfp4", SEED)
    set_dense(target, experts, "mxfp4")  # so that the FP8 projections are the only difference from `target`
    release = whole_release(tmp_path / "native", target, experts, "native_fp8_mxfp4")
    tensors = load_file(str(release / "model.safetensors"))
    for k in [k for k in tensors if k.endswith(FP8_WEIGHTS)]:
        w = tensors[k]
        tensors[k] = w.float().to(torch.float8_e4m3fn)
        blocks = ((w.shape[0] + 127) // 128, (w.shape[1] + 127) // 128)
        tensors[k.removesuffix("weight") + "scale"] = torch.randint(125, 129, blocks, dtype=torch.uint8).view(
            torch.float8_e8m0fnu)
    save_file(tensors, str(release / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((release / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                     "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    (release / "config.json").write_text(json.dumps(config))
    want = logits(DeepseekV4ForCausalLM.from_pretrained(release))
    model = DeepseekV4PackedExpertsForCausalLM.from_pretrained(release)
    assert not [n for n, _ in model.named_parameters() if n.endswith("experts.gate_up_proj")]
    torch.testing.assert_close(logits(model), want, rtol=1e-4, atol=1e-4)
    assert (logits(model) - logits(target)).abs().max() > 1e-3  # the FP8 rounding and scales are in effect
    print("quantizer:", getattr(model, "hf_quantizer", None), getattr(model.config, "quantization_config", None))
    model.save_pretrained(tmp_path / "again")  # on CPU transformers dequantised the projections: a dense save
    torch.testing.assert_close(logits(DeepseekV4PackedExpertsForCausalLM.from_pretrained(tmp_path / "again")),
                               want, rtol=1e-4, atol=1e-4)
    model.config.quantization_config = {"quant_method": "bitsandbytes"}  # a quantization this save cannot write
    with pytest.raises(NotImplementedError, match="bitsandbytes"):
        model.save_pretrained(tmp_path / "quantized")


def test_loading_packed_names_a_release_without_experts_or_another_model(tmp_path):
    target, mtp = tiny_pair(seed=SEED)
    release = whole_release(tmp_path / "r", target, {}, "native_fp8_mxfp4")  # every expert tensor dropped
    with pytest.raises(MtpCheckpointError, match="holds no routed experts"):
        DeepseekV4PackedExpertsForCausalLM.from_pretrained(release)
    mtp.save_pretrained(tmp_path / "mtp")
    with pytest.raises(TypeError, match="not a DeepSeek-V4 release"):
        DeepseekV4PackedExpertsForCausalLM.from_pretrained(tmp_path / "mtp")
    release = whole_release(tmp_path / "ok", target, packed_experts(target.config, "mxfp4", SEED), "native_fp8_mxfp4")
    with pytest.raises(ValueError, match="experts_implementation='dsv4_fp4'"):
        DeepseekV4PackedExpertsForCausalLM.from_pretrained(release, experts_implementation="grouped_mm")


def packed_buffers(model) -> list[torch.Tensor]:
    return [b for layer in model.model.layers for b in layer.mlp.experts.fp4.buffers()]


@pytest.mark.tf_internals
@pytest.mark.parametrize("fmt,shard", [("mxfp4", None), ("nvfp4", None), ("mxfp4", "100KB")],
                         ids=["mxfp4", "nvfp4", "mxfp4-sharded"])
def test_a_packed_target_saves_and_loads_back_packed_bit_for_bit(tmp_path, fmt, shard):
    """save_pretrained writes transformers' tensors as transformers does and the packed experts as a release
    stores them; DeepseekV4PackedExpertsForCausalLM reads them back, and the loaded model saves the same again."""
    print(f"seed={SEED}")
    target, mtp = tiny_pair(seed=SEED)
    set_dense(target, packed_experts(target.config, fmt, SEED), fmt)
    pack_fp4_experts(target, expert_format=fmt)
    want = logits(target)
    target.save_pretrained(tmp_path / "packed", **({"max_shard_size": shard} if shard else {}))
    saved = json.loads((tmp_path / "packed" / "model.safetensors.index.json").read_text())["weight_map"]
    assert not [k for k in saved if ".fp4." in k] and len({v for v in saved.values()}) > 1 + bool(shard)
    # transformers' own class sees the packed tensors (a size mismatch) instead of initialising random experts
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        DeepseekV4ForCausalLM.from_pretrained(tmp_path / "packed")
    model = DeepseekV4PackedExpertsForCausalLM.from_pretrained(tmp_path / "packed").eval()
    assert not [n for n, _ in model.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert model.model.layers[0].mlp.experts.fp4.format.name == fmt
    for got, ref in zip(packed_buffers(model), packed_buffers(target)):
        assert torch.equal(got, ref)
    torch.testing.assert_close(logits(model), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="safetensors"):
        model.save_pretrained(tmp_path / "pickled", safe_serialization=False)
    model.save_pretrained(tmp_path / "again")
    again = DeepseekV4PackedExpertsForCausalLM.from_pretrained(tmp_path / "again").eval()
    assert all(torch.equal(a, b) for a, b in zip(packed_buffers(again), packed_buffers(target)))
    mtp.bind(again)
    ids = torch.randint(3, again.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(SEED))
    plain = again.generate(ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(again.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=mtp), plain)


def test_in_memory_nvfp4_quantisation_is_a_real_close_requantisation():
    print(f"seed={SEED}")
    target, _ = tiny_pair(seed=SEED + 2)
    dense = [(layer.mlp.experts.gate_up_proj.detach().clone(), layer.mlp.experts.down_proj.detach().clone())
             for layer in target.model.layers]
    pack_fp4_experts(target, expert_format="nvfp4")
    for layer, (gate_up, down) in zip(target.model.layers, dense):
        p = layer.mlp.experts.fp4
        assert p.format.name == "nvfp4"
        for e in range(p.num_experts):
            w13, w2 = p.dequantized(e)
            for got, want in ((w13, gate_up[e]), (w2, down[e])):
                rel = float((got - want).norm() / want.norm())
                assert 0 < rel < 0.15, rel  # 4-bit rounding of random weights: lossy, never a no-op


def test_bad_input_names_the_problem(tmp_path):
    target, _ = tiny_pair(seed=SEED)
    experts = packed_experts(target.config, "mxfp4", SEED)
    with pytest.raises(TypeError, match="DeepSeek-V4"):
        pack_fp4_experts(torch.nn.Linear(2, 2))
    with pytest.raises(MtpCheckpointError, match=r"layers\.1\.ffn\.experts\.3\.w2\.scale"):
        pack_fp4_experts(target, write_release(tmp_path / "a", target.config, experts, "native_fp8_mxfp4",
                                               skip="layers.1.ffn.experts.3.w2.scale"))
    with pytest.raises(MtpCheckpointError, match="n_routed_experts: release 16, target 8"):
        pack_fp4_experts(target, write_release(tmp_path / "b", target.config, experts, "native_fp8_mxfp4",
                                               config_extra={"n_routed_experts": 16}))
    with pytest.raises(MtpCheckpointError, match="lossy re-quantisation"):
        pack_fp4_experts(target, write_release(tmp_path / "c", target.config, experts, "native_fp8_mxfp4"),
                         expert_format="nvfp4")
    with pytest.raises(MtpCheckpointError, match="no routed experts"):
        pack_fp4_experts(target, write_release(tmp_path / "d", target.config, {}, "native_fp8_mxfp4"))
    offloaded = tiny_pair(seed=SEED)[0]
    ex = offloaded.model.layers[2].mlp.experts
    ex.gate_up_proj = torch.nn.Parameter(torch.empty(ex.gate_up_proj.shape, device="meta"))  # what disk offload leaves
    with pytest.raises(ValueError, match=r"layers \[2\] are offloaded"):
        pack_fp4_experts(offloaded)
    assert target.config._experts_implementation != "dsv4_fp4"  # nothing was changed by the failures
    pack_fp4_experts(target)
    with pytest.raises(ValueError, match="already packed"):
        pack_fp4_experts(target)


def test_the_registered_implementation_without_packing_says_what_to_call():
    torch.manual_seed(SEED)
    target = DeepseekV4ForCausalLM(tiny_target_config()).eval()
    randomize_(target, torch.Generator().manual_seed(SEED))
    target.set_experts_implementation("dsv4_fp4")
    with pytest.raises(RuntimeError, match="pack_fp4_experts"):
        logits(target)


@pytest.mark.gpu
def test_packed_target_on_cuda_matches_the_bf16_target_and_stays_exact_with_the_mtp():
    """Sizes the Triton FP4 MoE tiles (multiples of 256): the CUDA kernels, not the reference."""
    print(f"seed={SEED}")
    target, mtp = tiny_pair(seed=SEED, target_overrides=dict(hidden_size=256, moe_intermediate_size=256,
                                                             n_routed_experts=16, num_experts_per_tok=4))
    set_dense(target, packed_experts(target.config, "mxfp4", SEED), "mxfp4")
    target, mtp = target.to("cuda", torch.bfloat16), mtp.to("cuda")
    mtp.bind(target)
    want = logits(target).float()
    ids = torch.randint(3, target.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(SEED)).cuda()
    pack_fp4_experts(target)
    got = logits(target).float()
    rel = float((got - want).norm() / want.norm())
    assert rel < 2e-2, rel  # bf16 noise: both sides round activations to bf16 in different places
    plain = target.generate(ids, max_new_tokens=24, do_sample=False)
    assisted = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=mtp, num_assistant_tokens=3)
    assert torch.equal(assisted, plain)
