"""Loading never initialises silently and never reads outside the checkpoint (issue 45, items 4, 5, 8).

Every case either loads exactly what the files hold or raises an error that names the problem (the
tensors, the file, the model_type) and the fix."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from dsv4_mtp_hf import DeepseekV4MtpForCausalLM, pack_fp4_experts
from dsv4_mtp_hf.loading import MtpCheckpointError
from dsv4_mtp_hf.target_runtime.experts import DeepseekV4PackedExpertsForCausalLM

from .helpers import tiny_pair
from .test_loading import make_release

# transformers' loader is what these guard: run on 5.17 too
pytestmark = pytest.mark.tf_internals
V4_FIELDS = ("hidden_size", "hc_mult", "n_routed_experts", "moe_intermediate_size", "o_groups")


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    target, ref, _, path = make_release(tmp_path_factory.mktemp("rel"), "native_fp8_mxfp4")
    return target, ref, path


@pytest.fixture(scope="module")
def saved_draft(tmp_path_factory):
    target, ref = tiny_pair(seed=3)
    path = tmp_path_factory.mktemp("draft") / "draft"
    ref.save_pretrained(path)
    return target, ref, path


def copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def assert_same_state(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


# -- (a) native tensors under a config without `model_type: deepseek_v4` ---------------------------------


@pytest.mark.parametrize("model_type", [None, "deepseek_v3"], ids=["no_model_type", "other_model_type"])
def test_native_tensors_under_a_config_without_the_v4_model_type_load_natively(tmp_path, release, model_type):
    target, _, src = release
    want = DeepseekV4MtpForCausalLM.from_pretrained(src, dtype=torch.float32)
    path = copy(src, tmp_path / "r")
    edit_json(path / "config.json", lambda c: c.pop("model_type") if model_type is None else c.update(model_type=model_type))
    got = DeepseekV4MtpForCausalLM.from_pretrained(path, target_model=target, dtype=torch.float32)
    assert_same_state(got, want)  # the release's tensors, not a random initialisation


def test_native_tensors_under_a_config_missing_v4_fields_name_them(tmp_path, release):
    _, _, src = release
    path = copy(src, tmp_path / "r")

    def strip(c):
        c.pop("model_type")
        for k in V4_FIELDS:
            c.pop(k)

    edit_json(path / "config.json", strip)
    with pytest.raises(MtpCheckpointError, match=r"mtp\.0\..*cannot be read as a DeepSeek-V4 config") as err:
        DeepseekV4MtpForCausalLM.from_pretrained(path)
    msg = str(err.value)
    assert all(k in msg for k in V4_FIELDS) and "deepseek_v4" in msg
    (path / "config.json").unlink()
    with pytest.raises(MtpCheckpointError, match=r"no config\.json"):
        DeepseekV4MtpForCausalLM.from_pretrained(path)


# -- (b) a saved draft that does not match the model --------------------------------------------------------


def damage(path: Path, edit) -> None:
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


@pytest.mark.parametrize("case", ["missing", "unexpected", "shape", "shape_ignored"])
def test_a_saved_draft_that_does_not_match_names_the_tensors(tmp_path, saved_draft, case):
    _, _, src = saved_draft
    path = copy(src, tmp_path / "d")
    if case == "missing":
        damage(path, lambda t: t.pop("block.self_attn.kv_proj.weight"))
        pattern = r"missing.*block\.self_attn\.kv_proj\.weight"
    elif case == "unexpected":
        damage(path, lambda t: t.update({"block.mlp.extra.weight": torch.ones(3)}))
        pattern = r"unexpected.*block\.mlp\.extra\.weight"
    else:
        damage(path, lambda t: t.update({"hnorm.weight": torch.ones(3)}))
        pattern = r"hnorm\.weight.*\[3\].*\[64\]"
    kwargs = {"ignore_mismatched_sizes": True} if case == "shape_ignored" else {}
    with pytest.raises(MtpCheckpointError, match=pattern) as err:
        DeepseekV4MtpForCausalLM.from_pretrained(path, **kwargs)
    assert "not randomly initialise" in str(err.value) or "save" in str(err.value)


def test_a_good_saved_draft_still_loads_and_reports_its_loading_info(saved_draft):
    target, ref, path = saved_draft
    model, info = DeepseekV4MtpForCausalLM.from_pretrained(path, target_model=target, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert_same_state(model, ref)
    assert model.target_model is target


# -- (c) another model's checkpoint ----------------------------------------------------------------------------


def test_a_llama_checkpoint_says_it_is_not_a_v4_mtp(tmp_path):
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    with pytest.raises(MtpCheckpointError, match=r"not a DeepSeek-V4 MTP checkpoint \(model_type 'llama'\)"):
        DeepseekV4MtpForCausalLM.from_pretrained(tmp_path / "llama")
    target, _ = tiny_pair()
    target.save_pretrained(tmp_path / "target")  # a V4 target saved by transformers: no mtp.* tensors
    with pytest.raises(MtpCheckpointError, match=r"no MTP layer"):
        DeepseekV4MtpForCausalLM.from_pretrained(tmp_path / "target")


# -- (d) truncated or corrupt files -----------------------------------------------------------------------------


def test_a_truncated_index_or_config_names_the_file(tmp_path, release):
    _, _, src = release
    path = copy(src, tmp_path / "r")
    index = path / "model.safetensors.index.json"
    index.write_text(index.read_text()[:100])
    with pytest.raises(MtpCheckpointError, match=r"model\.safetensors\.index\.json.*not valid JSON"):
        DeepseekV4MtpForCausalLM.from_pretrained(path)
    path = copy(src, tmp_path / "c")
    cfg = path / "config.json"
    cfg.write_text(cfg.read_text()[:50])
    with pytest.raises(MtpCheckpointError, match=r"config\.json.*not valid JSON"):
        DeepseekV4MtpForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_a_truncated_saved_draft_names_the_file(tmp_path, saved_draft, sharded):
    _, ref, _ = saved_draft
    path = tmp_path / "d"
    ref.save_pretrained(path, **({"max_shard_size": "30KB"} if sharded else {}))
    f = sorted(path.glob("model*.safetensors"))[-1]
    f.write_bytes(f.read_bytes()[:-64])  # an interrupted download
    with pytest.raises(MtpCheckpointError, match=rf"{f.name}.*corrupt"):
        DeepseekV4MtpForCausalLM.from_pretrained(path)
    if sharded:
        index = path / "model.safetensors.index.json"
        index.write_text(index.read_text()[:-20])
        with pytest.raises(MtpCheckpointError, match=r"model\.safetensors\.index\.json.*not valid JSON"):
            DeepseekV4MtpForCausalLM.from_pretrained(path)


# -- item 5: index shard names stay inside the checkpoint directory -------------------------------------------


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/../../outside.safetensors"])
def test_index_entries_outside_the_directory_are_refused(tmp_path, release, shard):
    _, _, src = release
    path = copy(src, tmp_path / "r")
    # a readable shard outside the directory, holding what the index promises
    outside = tmp_path / "outside.safetensors"
    shutil.copy(path / "model-00003-of-00003.safetensors", outside)
    name = str(outside) if shard.startswith("/") else shard
    if shard.startswith("sub/"):
        (path / "sub").mkdir()
    edit_json(path / "model.safetensors.index.json", lambda i: i["weight_map"].update({"mtp.0.enorm.weight": name}))
    with pytest.raises(MtpCheckpointError, match=r"mtp\.0\.enorm\.weight.*outside the checkpoint directory"):
        DeepseekV4MtpForCausalLM.from_pretrained(path)


def test_release_expert_index_entries_outside_the_directory_are_refused(tmp_path):
    from .test_target_experts import packed_experts, write_release

    target, _ = tiny_pair(seed=5)
    experts = packed_experts(target.config, "mxfp4", 5)
    path = write_release(tmp_path / "r", target.config, experts, "native_fp8_mxfp4")
    shutil.copy(path / "model-00002-of-00002.safetensors", tmp_path / "outside.safetensors")
    key = "layers.1.ffn.experts.0.w1.weight"
    edit_json(path / "model.safetensors.index.json", lambda i: i["weight_map"].update({key: "../outside.safetensors"}))
    with pytest.raises(MtpCheckpointError, match=rf"{key}.*outside the checkpoint directory"):
        pack_fp4_experts(target, path)
    with pytest.raises(MtpCheckpointError, match="outside the checkpoint directory"):
        DeepseekV4PackedExpertsForCausalLM.from_pretrained(path)


# -- files that are not there (issue 49, item 4) ----------------------------------------------------------------


def test_a_local_copy_missing_the_mtp_shard_names_it_and_says_local(tmp_path, release):
    _, _, src = release
    path = copy(src, tmp_path / "r")
    (path / "model-00003-of-00003.safetensors").unlink()
    with pytest.raises(MtpCheckpointError, match=r"model-00003-of-00003\.safetensors \(the index places the "
                       r"drafter's `mtp\.0\.\*` tensors in it\) is missing from the local directory .*incomplete") as e:
        DeepseekV4MtpForCausalLM.from_pretrained(path)
    assert "huggingface.co" not in str(e.value)  # a local path is not turned into a Hub URL


def test_a_path_that_is_no_directory_says_so(tmp_path):
    with pytest.raises(MtpCheckpointError, match=r"no such local directory"):
        DeepseekV4MtpForCausalLM.from_pretrained(tmp_path / "not-there")


def test_missing_mtp_tensors_name_the_mtp_class(tmp_path, release):
    _, _, src = release
    path = copy(src, tmp_path / "r")
    shard = path / "model-00003-of-00003.safetensors"
    tensors = load_file(str(shard))
    tensors.pop("mtp.0.e_proj.weight")
    tensors.pop("mtp.0.e_proj.scale", None)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    edit_json(path / "model.safetensors.index.json",
              lambda i: [i["weight_map"].pop(k, None) for k in ("mtp.0.e_proj.weight", "mtp.0.e_proj.scale")])
    with pytest.raises(MtpCheckpointError, match=r"The MTP layer \(DeepseekV4MtpForCausalLM\) in this checkpoint is "
                       r"incomplete: 1 required.*mtp\.0\.e_proj\.weight"):
        DeepseekV4MtpForCausalLM.from_pretrained(path)
