"""Export of a drafter in DeepSeek's release layout for serving engines (issue #48, item 6):
``save_pretrained(dir, layout="release")`` writes ``mtp.0.*`` (DSpark: ``mtp.0..N-1.*``) as the release stores them
and the target's config; our own release loader reads the export back.

Test names and directories here avoid the words vLLM reads as another speculative method (the export refuses
paths holding them, and pytest's tmp_path carries the test's name)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from dsv4_mtp_hf import DeepseekV4DSparkForCausalLM, DeepseekV4MtpForCausalLM, fp4
from dsv4_mtp_hf.loading import SaveDirectoryError
from dsv4_mtp_hf.loading.export import encode_fp8
from dsv4_mtp_hf.fp8 import dequantize_fp8_block, quantize_fp8_block
from dsv4_mtp_hf.loading.native import RELEASE_SCALES, release_scales

from .dspark_release import random_dspark_tensors, random_target_shared, tiny_dspark_config, write_dspark_release
from .helpers import tiny_pair
from .test_loading import TARGET_OVERRIDES, make_release, write_release

E8M0 = torch.float8_e8m0fnu
INDEX = "model.safetensors.index.json"


def engine_mtp_names(n_routed_experts: int, shared_expert: bool = True) -> set[str]:
    """The tensors an engine maps for one V4 MTP layer (SPEC §6's table, the V4-Flash release's ``mtp.0.*``),
    written out here independently of the package's tables."""
    fp8 = ["e_proj", "h_proj", "attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b"]
    if shared_expert:
        fp8 += ["ffn.shared_experts.w1", "ffn.shared_experts.w3", "ffn.shared_experts.w2"]
    names = {f"{m}.{s}" for m in fp8 for s in ("weight", "scale")}
    names |= {f"{n}.weight" for n in ("enorm", "hnorm", "norm", "attn_norm", "ffn_norm", "attn.q_norm", "attn.kv_norm")}
    names |= {f"hc_{p}_{x}" for p in ("head", "attn", "ffn") for x in ("fn", "base", "scale")}
    names |= {"attn.attn_sink", "ffn.gate.weight", "ffn.gate.bias"}
    names |= {f"ffn.experts.{e}.{m}.{s}" for e in range(n_routed_experts) for m in ("w1", "w3", "w2")
              for s in ("weight", "scale")}
    return {"mtp.0." + n for n in names}


def test_the_engine_name_list_is_the_flash_table():
    assert len(engine_mtp_names(256)) == 1575  # SPEC §6: the V4-Flash release's MTP holds 1575 tensors


def test_a_flash_sized_mtp_plans_the_flash_release_tensors():
    """The export's plan for a V4-Flash-sized MTP (on the meta device): SPEC §6's names, dtypes and shapes."""
    from dsv4_mtp_hf import DeepseekV4MtpConfig
    from dsv4_mtp_hf.loading.export import release_plan

    from .helpers import CONFIGS

    config = DeepseekV4MtpConfig.from_json_file(str(CONFIGS / "deepseek-v4-flash-mtp.json"))
    with torch.device("meta"):
        model = DeepseekV4MtpForCausalLM._from_config(config, dtype=torch.bfloat16)
    header, units = release_plan(model)
    assert set(header) == engine_mtp_names(256) and sum(len(u.sources) for u in units) == 1575
    spec = {"e_proj.weight": ("F8_E4M3", (4096, 4096)), "e_proj.scale": ("F8_E8M0", (32, 32)),
            "attn.wq_b.weight": ("F8_E4M3", (32768, 1024)), "attn.wq_b.scale": ("F8_E8M0", (256, 8)),
            "attn.wo_a.scale": ("F8_E8M0", (64, 32)), "attn.wo_b.scale": ("F8_E8M0", (32, 64)),
            "ffn.shared_experts.w2.scale": ("F8_E8M0", (32, 16)), "attn.q_norm.weight": ("BF16", (1024,)),
            "hc_head_fn": ("F32", (4, 16384)), "hc_attn_fn": ("F32", (24, 16384)), "hc_ffn_scale": ("F32", (3,)),
            "attn.attn_sink": ("F32", (64,)), "ffn.gate.weight": ("BF16", (256, 4096)),
            "ffn.gate.bias": ("F32", (256,)),
            "ffn.experts.255.w1.weight": ("I8", (2048, 2048)), "ffn.experts.255.w1.scale": ("F8_E8M0", (2048, 128)),
            "ffn.experts.0.w2.weight": ("I8", (4096, 1024)), "ffn.experts.0.w2.scale": ("F8_E8M0", (4096, 64))}
    for name, want in spec.items():
        assert header["mtp.0." + name] == want, name


def stored(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, by the index."""
    index = json.loads((path / INDEX).read_text())["weight_map"]
    out = {}
    for shard in sorted(set(index.values())):
        with safe_open(str(path / shard), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    assert set(out) == set(index)
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def state(model) -> dict[str, torch.Tensor]:
    return dict(model.state_dict())


def release_dtypes(names) -> dict[str, torch.dtype]:
    """SPEC §6's dtypes by name."""
    out = {}
    for n in names:
        if n.endswith(".scale"):
            out[n] = E8M0
        elif ".experts." in n:
            out[n] = torch.int8
        elif any(n.endswith(f"{m}.weight") for m in ("e_proj", "h_proj", "wq_a", "wq_b", "wkv", "wo_a", "wo_b")) \
                or ".shared_experts." in n:
            out[n] = torch.float8_e4m3fn
        elif n.endswith(".weight"):  # norms, the router
            out[n] = torch.bfloat16
        else:  # mHC, sinks, router bias
            out[n] = torch.float32
    return out


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """A tiny native release (FP8 + E8M0, MXFP4 experts) and its target: (target, tensors, release path)."""
    target, _, tensors, path = make_release(tmp_path_factory.mktemp("rel"), "native_fp8_mxfp4")
    return target, tensors, path


# -- a drafter loaded from a release ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mtp_from_a_release_exports_the_release_bytes_and_reloads_bit_for_bit(tmp_path, native, dtype):
    target, tensors, path = native
    mtp = DeepseekV4MtpForCausalLM.from_pretrained(path, target_model=target, dtype=dtype)
    out = tmp_path / "v4-mtp-release"
    files = mtp.save_pretrained(out, layout="release")
    assert sorted(p.name for p in out.iterdir()) == sorted(files)
    got = stored(out)
    assert set(got) == engine_mtp_names(mtp.config.n_routed_experts)  # exactly those names, nothing else
    assert set(got) == set(tensors)
    for k, t in tensors.items():
        assert same_bytes(got[k], t), k
    assert {k: t.dtype for k, t in got.items()} == release_dtypes(got)
    back = DeepseekV4MtpForCausalLM.from_pretrained(out, target_model=target, dtype=dtype)
    a, b = state(mtp), state(back)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_the_stored_fp8_scales_are_written_back_where_the_recipe_would_pick_others(tmp_path, native):
    """A release whose FP8 blocks use larger scales than DeepSeek's recipe gives for their values (every |code|
    below 224): the export still writes the release's bytes, from the scales kept at load; without them the
    values agree and the bytes do not."""
    target, tensors, _ = native
    g = torch.Generator().manual_seed(5)
    edited = dict(tensors)
    for name in ("mtp.0.e_proj", "mtp.0.attn.wq_b"):
        w = tensors[name + ".weight"]
        edited[name + ".weight"] = (torch.randn(w.shape, generator=g) * 40).clamp(-200, 200).to(torch.float8_e4m3fn)
        scale = tensors[name + ".scale"]
        edited[name + ".scale"] = torch.randint(118, 126, scale.shape, generator=g, dtype=torch.uint8).view(E8M0)
    path = write_release(tmp_path / "rel", target, edited, {"expert_dtype": "fp4"})
    mtp = DeepseekV4MtpForCausalLM.from_pretrained(path, target_model=target, dtype=torch.bfloat16)
    assert set(release_scales(mtp)) >= {"e_proj.weight", "block.self_attn.q_b_proj.weight"}
    mtp.save_pretrained(tmp_path / "out", layout="release")
    got = stored(tmp_path / "out")
    for k, t in edited.items():
        assert same_bytes(got[k], t), k
    del mtp.__dict__[RELEASE_SCALES]  # as for a draft saved in our own layout and loaded again
    mtp.save_pretrained(tmp_path / "fresh", layout="release")
    fresh = stored(tmp_path / "fresh")
    assert not same_bytes(fresh["mtp.0.e_proj.scale"], edited["mtp.0.e_proj.scale"])
    values = [dequantize_fp8_block(t["mtp.0.e_proj.weight"], t["mtp.0.e_proj.scale"], torch.float32)
              for t in (fresh, edited)]
    assert torch.equal(*values)


def test_a_changed_weight_is_quantised_afresh():
    w = torch.randn(200, 300)
    q, s = quantize_fp8_block(w)
    exact = dequantize_fp8_block(q, s, torch.float32)
    q2, s2, reused = encode_fp8(exact, s)
    assert reused and torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
    trained = exact + 1e-3 * torch.randn(200, 300)
    q3, s3, reused = encode_fp8(trained, s)
    assert not reused
    r3, rs = quantize_fp8_block(trained)
    assert torch.equal(q3.view(torch.uint8), r3.view(torch.uint8))
    assert torch.equal(s3.view(torch.uint8), rs.view(torch.uint8))


# -- a drafter that never came from a release ---------------------------------------------------------------------


def test_a_bf16_draft_is_quantised_to_the_release_formats_and_still_generates_exactly(tmp_path):
    target, mtp = tiny_pair(seed=3, target_overrides=TARGET_OVERRIDES)
    mtp = mtp.to(torch.bfloat16)
    out = tmp_path / "trained-draft"
    mtp.save_pretrained(out, layout="release")
    got = stored(out)
    assert set(got) == engine_mtp_names(mtp.config.n_routed_experts)
    assert {k: t.dtype for k, t in got.items()} == release_dtypes(got)
    back = DeepseekV4MtpForCausalLM.from_pretrained(out, target_model=target, dtype=torch.bfloat16)
    a, b = state(mtp), state(back)
    assert a.keys() == b.keys()
    linears = {k for k in a if k.endswith(".weight") and a[k].dim() == 2 and "mlp.gate." not in k}
    assert len(linears) == 10
    for k in a:
        if k in linears:  # quantised on export: the reload holds exactly the FP8 values of the recipe
            q, s = quantize_fp8_block(a[k])
            assert torch.equal(b[k], dequantize_fp8_block(q, s, torch.bfloat16)), k
        else:  # norms, mHC, router (BF16 / F32 as stored), packed experts: unchanged
            assert torch.equal(b[k].to(a[k].dtype), a[k]), k
    ids = torch.randint(3, 320, (1, 11), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=30, do_sample=False, eos_token_id=None)
    plain = target.generate(ids, **kw)
    assert torch.equal(target.generate(ids, assistant_model=back, num_assistant_tokens=3, **kw), plain)
    assert back.last_generation_stats.rounds > 0


def test_nvfp4_experts_are_quantised_to_mxfp4_with_a_warning(tmp_path, caplog):
    target, mtp = tiny_pair(seed=4, expert_format="nvfp4", target_overrides=TARGET_OVERRIDES)
    mtp.save_pretrained(tmp_path / "out", layout="release")
    assert "quantised to MXFP4" in caplog.text
    got = stored(tmp_path / "out")
    assert got["mtp.0.ffn.experts.0.w1.weight"].dtype == torch.int8
    assert set(got) == engine_mtp_names(mtp.config.n_routed_experts)  # no NVFP4 global scales
    back = DeepseekV4MtpForCausalLM.from_pretrained(tmp_path / "out", target_model=target, dtype=torch.float32)
    assert back.config.expert_format == "mxfp4"
    ex, bx = mtp.block.mlp.experts, back.block.mlp.experts
    for e in range(ex.num_experts):
        w13, w2 = ex.dequantized(e)
        i = ex.intermediate_size
        want = [fp4.dequantize_fp4(*fp4.quantize_fp4(w, "mxfp4")[:2], "mxfp4") for w in (w13[:i], w13[i:], w2)]
        got13, got2 = bx.dequantized(e)
        assert torch.equal(got13, torch.cat(want[:2])) and torch.equal(got2, want[2])


# -- config.json ---------------------------------------------------------------------------------------------------


def test_the_config_is_the_targets_with_the_release_fields(tmp_path, native):
    target, _, path = native
    mtp = DeepseekV4MtpForCausalLM.from_pretrained(path, target_model=target)
    mtp.save_pretrained(tmp_path / "bound", layout="release")  # the bound target's config
    cfg = json.loads((tmp_path / "bound" / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v4" and cfg["architectures"] == ["DeepseekV4ForCausalLM"]
    assert cfg["num_hidden_layers"] == target.config.num_hidden_layers == 3
    assert cfg["num_nextn_predict_layers"] == 1 and not any(k.startswith("dspark_") for k in cfg)
    assert cfg["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                          "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    assert cfg["expert_dtype"] == "fp4" and "auto_map" not in cfg
    # DeepSeek's names beside transformers': the MTP layer (index num_hidden_layers) is sliding-window only
    assert cfg["compress_ratios"] == [0, 4, 8, 0] and cfg["num_hash_layers"] == 1
    assert cfg["qk_rope_head_dim"] == mtp.config.qk_rope_head_dim and cfg["rope_theta"] == 10000.0
    reread = DeepseekV4Config.from_pretrained(tmp_path / "bound")
    assert reread.layer_types == target.config.layer_types and reread.mlp_layer_types == target.config.mlp_layer_types
    # the release's own config.json, copied as it is (fields we must set aside)
    raw = json.loads((path / "config.json").read_text())
    raw.update(dspark_block_size=5, dspark_target_layer_ids=[0, 1, 2], custom_field="kept", num_nextn_predict_layers=0)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps(raw))
    mtp.unbind()
    mtp.save_pretrained(tmp_path / "copied", layout="release", target_config=tmp_path / "src")
    cfg = json.loads((tmp_path / "copied" / "config.json").read_text())
    assert cfg["custom_field"] == "kept" and cfg["num_nextn_predict_layers"] == 1
    assert not any(k.startswith("dspark_") for k in cfg)
    back = DeepseekV4MtpForCausalLM.from_pretrained(tmp_path / "copied", target_model=target)
    assert all(torch.equal(v, state(back)[k]) for k, v in state(mtp).items())


def test_the_config_must_come_from_the_drafters_target(tmp_path, native):
    target, _, path = native
    mtp = DeepseekV4MtpForCausalLM.from_pretrained(path)
    with pytest.raises(ValueError, match="target_config"):
        mtp.save_pretrained(tmp_path / "a", layout="release")  # unbound, no target_config
    other = {**target.config.to_dict(), "hidden_size": 256}
    with pytest.raises(ValueError, match="hidden_size"):
        mtp.save_pretrained(tmp_path / "b", layout="release", target_config=other)
    with pytest.raises(ValueError, match="deepseek_v4"):
        mtp.save_pretrained(tmp_path / "c", layout="release", target_config={"model_type": "llama"})
    assert not any((tmp_path / n).exists() for n in "abc")
    with pytest.raises(ValueError, match="layout"):
        mtp.save_pretrained(tmp_path / "d", layout="vllm")
    with pytest.raises(ValueError, match="target_config"):
        mtp.save_pretrained(tmp_path / "d", target_config=target.config)


# -- the directory -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["v4-DSpark-mtp", "my_eagle3_mtp", "EAGLE-v4", "dflash-copy"])
def test_a_path_an_engine_reads_as_another_method_is_refused(tmp_path, native, name):
    target, _, path = native
    mtp = DeepseekV4MtpForCausalLM.from_pretrained(path, target_model=target)
    with pytest.raises(ValueError, match="vLLM infers the speculative method") as e:
        mtp.save_pretrained(tmp_path / name / "draft", layout="release")
    word = next(w for w in ("dspark", "eagle3", "eagle-", "dflash") if w in name.lower())
    assert repr(word) in str(e.value)
    assert not (tmp_path / name).exists()


def test_the_export_never_overwrites_another_models_files(tmp_path, native):
    target, tensors, path = native
    mtp = DeepseekV4MtpForCausalLM.from_pretrained(path, target_model=target)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    with pytest.raises(SaveDirectoryError):
        mtp.save_pretrained(path, layout="release")  # the release it was loaded from
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    mtp.save_pretrained(tmp_path / "ours")  # our own layout: another model type
    with pytest.raises(SaveDirectoryError):
        mtp.save_pretrained(tmp_path / "ours", layout="release")
    # an earlier export is replaced: its files are removed when not rewritten, other files stay
    out = tmp_path / "exported"
    mtp.save_pretrained(out, layout="release", max_shard_size=20_000)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2
    (out / "README.md").write_text("notes")
    mtp.save_pretrained(out, layout="release")
    assert sorted(p.name for p in out.iterdir()) == sorted(["README.md", "config.json", INDEX,
                                                            "model-00001-of-00001.safetensors"])
    got = stored(out)
    assert all(same_bytes(got[k], t) for k, t in tensors.items())
    # a stray safetensors file that is not ours makes the folder foreign
    save_file({"embed.weight": torch.zeros(2, 2)}, str(out / "extra.safetensors"))
    with pytest.raises(SaveDirectoryError):
        mtp.save_pretrained(out, layout="release")


# -- DSpark ----------------------------------------------------------------------------------------------------------


def test_dspark_from_a_release_exports_the_release_bytes_and_reloads(tmp_path):
    cfg = tiny_dspark_config()
    tensors, shared = random_dspark_tensors(cfg, seed=7), random_target_shared(cfg, seed=8)
    path = write_dspark_release(tmp_path / "release", cfg, tensors, shared)
    drafter = DeepseekV4DSparkForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = tmp_path / "v4-dspark-release"  # "dspark" names DSpark's own method: allowed
    drafter.save_pretrained(out, layout="release", target_config=path)
    got = stored(out)
    assert set(got) == set(tensors)  # mtp.0..2.*, no embedding / head
    for k, t in tensors.items():
        assert same_bytes(got[k], t), k
    c = json.loads((out / "config.json").read_text())
    assert c["model_type"] == "deepseek_v4" and c["num_hidden_layers"] == cfg["num_hidden_layers"]
    assert {k: c[k] for k in c if k.startswith("dspark_")} == {k: cfg[k] for k in cfg if k.startswith("dspark_")}
    assert c["num_nextn_predict_layers"] == 1
    target = DeepseekV4ForCausalLM(DeepseekV4Config(**cfg))
    back = DeepseekV4DSparkForCausalLM.from_pretrained(out, target_model=target, dtype=torch.float32)
    a, b = state(drafter), state(back)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="'eagle3'"):
        drafter.save_pretrained(tmp_path / "dspark_eagle3", layout="release", target_config=path)
