"""save_pretrained never destroys another model's files (issue 45, item 2).

transformers' save overwrites ``config.json`` and deletes every ``model-XXXXX-of-YYYYY`` shard it does not
write: saving the draft (or a packed target) into the folder of the release it came from would delete the
release.  Both saves refuse a directory holding another model's config or weights, leaving it byte for byte
as it was, and still save over their own earlier saves."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dsv4_mtp_hf import DeepseekV4MtpForCausalLM, pack_fp4_experts
from dsv4_mtp_hf.loading.save_guard import SaveDirectoryError
from dsv4_mtp_hf.target_runtime.experts import DeepseekV4PackedExpertsForCausalLM

from .helpers import tiny_pair
from .test_loading import make_release

# transformers' save and load are what these guard: run on 5.17 too
pytestmark = pytest.mark.tf_internals
REFUSED = r"Refusing to save the .* an empty or new directory"


def snapshot(path: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


def state(model) -> dict:
    return dict(model.state_dict())


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    target, ref, _, path = make_release(tmp_path_factory.mktemp("rel"), "native_fp8_mxfp4")
    return target, ref, path


def test_the_draft_refuses_the_release_it_was_loaded_from_and_leaves_it_intact(release):
    target, _, path = release
    before = snapshot(path)
    mtp = DeepseekV4MtpForCausalLM.from_pretrained(path, target_model=target, dtype=torch.float32)
    with pytest.raises(SaveDirectoryError, match=REFUSED) as err:
        mtp.save_pretrained(path)
    msg = str(err.value)
    assert "'deepseek_v4' model" in msg and "model-00001-of-00003.safetensors" in msg
    assert snapshot(path) == before
    with pytest.raises(SaveDirectoryError):
        mtp.save_pretrained(path, max_shard_size="20KB")  # sharded: same refusal
    assert snapshot(path) == before
    DeepseekV4MtpForCausalLM.from_pretrained(path, dtype=torch.float32)  # the release still loads


@pytest.mark.parametrize("case", ["foreign_config", "config_without_model_type", "bare_shards", "index_only",
                                  "pickle", "transformers_target", "draft_config_with_foreign_shard"])
def test_the_draft_refuses_any_other_models_files(tmp_path, release, case):
    target, ref, _ = release
    d = tmp_path / case
    d.mkdir()
    if case == "foreign_config":
        (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    elif case == "config_without_model_type":
        (d / "config.json").write_text(json.dumps({"hidden_size": 8}))
    elif case == "bare_shards":  # weights without a config: whose they are is unknown
        save_file({"layers.0.attn.wq_a.weight": torch.zeros(2, 2)}, str(d / "model-00001-of-00002.safetensors"))
    elif case == "index_only":
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"embed.weight": "x.safetensors"}}))
    elif case == "pickle":
        torch.save({"w": torch.zeros(1)}, d / "pytorch_model.bin")
    elif case == "transformers_target":
        target.save_pretrained(d, max_shard_size="50KB")
    else:  # our config, but a shard the draft never writes (a release copied in beside it)
        ref.save_pretrained(d)
        save_file({"embed.weight": torch.zeros(2, 2)}, str(d / "model-00001-of-00002.safetensors"))
    before = snapshot(d)
    with pytest.raises(SaveDirectoryError, match=REFUSED):
        ref.save_pretrained(d)
    assert snapshot(d) == before


def test_the_draft_saves_over_its_own_earlier_saves_and_beside_unrelated_files(tmp_path, release):
    target, ref, _ = release
    d = tmp_path / "draft"
    d.mkdir()
    (d / "README.md").write_text("notes")
    (d / "tokenizer.json").write_text("{}")
    torch.save({"lr": 1e-4}, d / "training_args.bin")  # a Trainer's output folder: not weights
    for shard in ("30KB", None, "30KB", "60KB"):  # sharded, whole, sharded again (other shard counts)
        ref.save_pretrained(d, **({"max_shard_size": shard} if shard else {}))
        back = DeepseekV4MtpForCausalLM.from_pretrained(d, target_model=target)
        a, b = state(ref), state(back)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), shard
    assert (d / "README.md").read_text() == "notes" and (d / "tokenizer.json").exists()
    assert json.loads((d / "config.json").read_text())["model_type"] == "deepseek_v4_mtp"


def packed_target(seed=0):
    target, mtp = tiny_pair(seed=seed)
    pack_fp4_experts(target)
    return target, mtp


def packed_buffers(model) -> list[torch.Tensor]:
    return [b for layer in model.model.layers for b in layer.mlp.experts.fp4.buffers()]


@pytest.mark.parametrize("how", ["pack_fp4_experts", "DeepseekV4PackedExpertsForCausalLM"])
def test_a_packed_target_refuses_a_release_a_draft_and_a_transformers_save(tmp_path, release, how):
    _, ref, path = release
    target, _ = packed_target()
    saved = tmp_path / "packed"
    target.save_pretrained(saved)
    model = target if how == "pack_fp4_experts" else DeepseekV4PackedExpertsForCausalLM.from_pretrained(saved)
    plain, _ = tiny_pair()
    plain.save_pretrained(tmp_path / "dense")  # transformers' own save of a V4 target (bf16 experts)
    ref.save_pretrained(tmp_path / "draft")
    for d in (path, tmp_path / "dense", tmp_path / "draft"):
        before = snapshot(d)
        with pytest.raises(SaveDirectoryError, match=REFUSED):
            model.save_pretrained(d)
        with pytest.raises(SaveDirectoryError, match=REFUSED):
            model.save_pretrained(d, max_shard_size="100KB")
        assert snapshot(d) == before, d


def test_a_packed_target_saves_over_its_own_earlier_saves(tmp_path):
    target, _ = packed_target()
    d = tmp_path / "packed"
    d.mkdir()
    (d / "README.md").write_text("notes")
    for shard in ("100KB", None, "100KB", "300KB"):
        target.save_pretrained(d, **({"max_shard_size": shard} if shard else {}))
        index = json.loads((d / "model.safetensors.index.json").read_text())
        listed = set(index["weight_map"].values())
        on_disk = {p.name for p in d.glob("*.safetensors")}
        assert on_disk == listed, shard  # nothing stale, nothing unlisted
        back = DeepseekV4PackedExpertsForCausalLM.from_pretrained(d).eval()
        assert all(torch.equal(a, b) for a, b in zip(packed_buffers(back), packed_buffers(target))), shard
        back.save_pretrained(d, **({"max_shard_size": shard} if shard else {}))  # the loaded model saves there too
    assert (d / "README.md").read_text() == "notes"
