"""DSpark's careless-user errors (beside the MTP's, ``test_loading_errors.py``): every case raises an error that
names the drafter (``DeepseekV4DSparkForCausalLM``), the problem and the fix -- or, where the fix is stated, shows
that it works.  A tiny 0731-layout release (``tests/dspark_release.py``) and its 3-layer target serve every case."""

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from dsv4_mtp_hf import DeepseekV4DSparkConfig, DeepseekV4DSparkForCausalLM, DeepseekV4MtpForCausalLM, patching
from dsv4_mtp_hf.generation import speculative_generate
from dsv4_mtp_hf.generation.binding import _drafter_of_call
from dsv4_mtp_hf.generation.speculative import mtp_decoding
from dsv4_mtp_hf.loading import MtpCheckpointError
from dsv4_mtp_hf.loading.detect import load_drafter

from .dspark_release import random_dspark_tensors, random_target_shared, tiny_dspark_config, write_dspark_release
from .helpers import unbound_assistant_pattern

SMALL = dict(hidden_size=64, moe_intermediate_size=32, head_dim=32, q_lora_rank=32, o_lora_rank=16,
             dspark_markov_rank=8)
NAME = "DeepseekV4DSparkForCausalLM"
RELEASE = "deepseek-ai/DeepSeek-V4-Flash-0731"
IDS = torch.tensor([[5, 6, 7, 8]])


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(directory, config dict, stored drafter tensors, stored embed/head) of a tiny 0731-layout release."""
    cfg = tiny_dspark_config(**SMALL)
    tensors, shared = random_dspark_tensors(cfg, seed=7), random_target_shared(cfg, seed=8)
    path = write_dspark_release(tmp_path_factory.mktemp("dspark") / "release", cfg, tensors, shared)
    return path, cfg, tensors, shared


def target_of(cfg: dict, **overrides) -> DeepseekV4ForCausalLM:
    return DeepseekV4ForCausalLM(DeepseekV4Config(**{**cfg, **overrides})).eval()


def variant(tmp_path: Path, release, config_edit=None, drop=lambda name: False) -> Path:
    """The release rewritten with its config edited and the tensors ``drop`` names left out (index and shard)."""
    _, cfg, tensors, shared = release
    cfg = json.loads(json.dumps(cfg))
    if config_edit is not None:
        config_edit(cfg)
    kept = {k: v for k, v in tensors.items() if not drop(k)}
    return write_dspark_release(tmp_path / "variant", cfg, kept, shared)


# -- an unbound drafter passed as `assistant_model` -------------------------------------------------------------


@pytest.mark.tf_internals
@pytest.mark.parametrize("how", ["unbind", "bound_elsewhere", "loaded_without_target"])
def test_an_unbound_dspark_as_assistant_model_says_to_bind_it(release, how):
    """transformers' own candidate generator used to read DSpark's `num_assistant_tokens="auto"` first
    (`int('auto')`).  On a target with no drafter of ours, transformers <= 5.24 refuses V4 itself; 5.25 asks the
    drafter, which names its state and the fix.  On a target that has a drafter bound, our handler answers."""
    path, cfg, _, _ = release
    target = target_of(cfg)
    if how == "loaded_without_target":
        dspark = DeepseekV4DSparkForCausalLM.from_pretrained(path)
    else:
        dspark = DeepseekV4DSparkForCausalLM.from_pretrained(path, target_model=target)
        dspark.unbind() if how == "unbind" else dspark.bind(target_of(cfg))
    elsewhere = how == "bound_elsewhere"
    with pytest.raises(ValueError, match=unbound_assistant_pattern(bound_elsewhere=elsewhere)) as err:
        target.generate(IDS, assistant_model=dspark, max_new_tokens=3)
    assert "int()" not in str(err.value)
    other = DeepseekV4DSparkForCausalLM.from_pretrained(path, target_model=target, dtype=torch.float64)
    ours = (r"not bound to the target you generate with: it is bound to another" if elsewhere else
            r"not bound to a target \(never bound")
    with pytest.raises(ValueError, match=NAME + ".*" + ours + r".*drafter\.bind\(target\)"):
        target.generate(IDS, assistant_model=dspark, max_new_tokens=3)  # our handler, on every version
    assert other.is_bound


def test_drafter_generate_names_the_drafter(release):
    path, _, _, _ = release
    with pytest.raises(RuntimeError, match=NAME + r" is not bound to a target.*cannot run alone"):
        DeepseekV4DSparkForCausalLM.from_pretrained(path).generate(IDS)


# -- batches --------------------------------------------------------------------------------------------------


def test_batches_take_dspark_and_refuse_a_drafter_without_a_batch_part(release, monkeypatch):
    """A release's DSpark drafts batches (greedy: each sequence as plain `generate` alone); a drafter of ours that
    has no batch part is refused by name, with what serves it (batch 1)."""
    from dsv4_mtp_hf.generation import drafter

    path, cfg, _, _ = release
    target = target_of(cfg)
    dspark = DeepseekV4DSparkForCausalLM.from_pretrained(path, target_model=target)
    prompts = [IDS[0], IDS[0, :2]]
    out = speculative_generate(target, dspark, prompts, max_new_tokens=3, eos_token_id=None)
    for p, new in zip(prompts, out.new_tokens):
        assert torch.equal(new, target.generate(p[None], max_new_tokens=3, eos_token_id=None)[0, p.numel():])
    monkeypatch.delitem(drafter.BATCH_DRAFTERS, "deepseek_v4_dspark")
    pattern = NAME + r"; it drafts one sequence.*`target\.generate\(prompt\[None\], assistant_model=drafter\)` \(batch 1\)"
    with pytest.raises(ValueError, match=pattern):
        speculative_generate(target, dspark, prompts, max_new_tokens=3)


@pytest.mark.tf_internals
def test_mtp_decoding_takes_dspark_under_its_old_names(release):
    """`custom_generate=mtp_decoding, mtp=drafter` (the names from before DSpark batched) run DSpark's batches."""
    path, cfg, _, _ = release
    target = target_of(cfg)
    dspark = DeepseekV4DSparkForCausalLM.from_pretrained(path, target_model=target)
    out = target.generate(IDS, custom_generate=mtp_decoding, mtp=dspark, max_new_tokens=3, eos_token_id=None)
    assert torch.equal(out, target.generate(IDS, max_new_tokens=3, eos_token_id=None))
    assert len(dspark.last_generation_stats) == 1


# -- incomplete releases -----------------------------------------------------------------------------------------


def test_a_release_missing_a_whole_block_names_the_block_and_the_shard(tmp_path, release):
    path = variant(tmp_path, release, drop=lambda k: k.startswith("mtp.1."))
    for load in (DeepseekV4DSparkForCausalLM.from_pretrained, load_drafter):
        with pytest.raises(MtpCheckpointError, match=NAME + r".*incomplete.*mtp\.0, mtp\.2 but no tensor of "
                           r"mtp\.1\.\*.*model-00002-of-00002\.safetensors.*download") as err:
            load(path)
        assert "KeyError" not in repr(err.value)


def test_missing_dspark_tensors_are_reported_as_dsparks(tmp_path, release):
    path = variant(tmp_path, release, drop=lambda k: k == "mtp.1.attn.wkv.weight")
    pattern = (r"The DSpark drafter \(" + NAME + r"\) in this checkpoint is incomplete: 1 required.*"
               r"mtp\.1\.attn\.wkv\.weight.*Download the index and those shards")
    with pytest.raises(MtpCheckpointError, match=pattern) as err:
        DeepseekV4DSparkForCausalLM.from_pretrained(path)
    assert "MTP" not in str(err.value)


def test_another_drafters_keyword_is_refused_by_name(release):
    with pytest.raises(TypeError, match=r"loading " + NAME + r" .*\['mtp_vocab_size'\]"):
        DeepseekV4DSparkForCausalLM.from_pretrained(release[0], mtp_vocab_size=100)


@pytest.mark.parametrize("keys", [["dspark_block_size"], ["dspark_target_layer_ids"],
                                  ["dspark_block_size", "dspark_target_layer_ids"]], ids=["block", "layers", "both"])
def test_a_config_without_dspark_fields_is_called_incomplete_and_the_fix_works(tmp_path, release, keys):
    """Both classes agree: the tensors are DSpark's (the MTP class says so), the config lacks the named keys."""
    path = variant(tmp_path, release, config_edit=lambda c: [c.pop(k) for k in keys])
    for load in (DeepseekV4DSparkForCausalLM.from_pretrained, load_drafter):
        with pytest.raises(MtpCheckpointError, match=r"DSpark drafter tensors.*config\.json has no "
                           + ", ".join(keys) + r": the config is incomplete.*Restore the release's config\.json"):
            load(path)
    with pytest.raises(MtpCheckpointError, match=r"ships the DSpark drafter.*use " + NAME):
        DeepseekV4MtpForCausalLM.from_pretrained(path)
    values = {k: release[1][k] for k in keys}  # the fix the message offers: pass the release's values
    got = DeepseekV4DSparkForCausalLM.from_pretrained(path, **values)
    assert (got.config.dspark_block_size, got.config.dspark_target_layer_ids) == (5, [0, 1, 2])


def test_a_target_config_without_dspark_fields_names_them_and_both_fixes():
    with pytest.raises(ValueError, match=r"no dspark_target_layer_ids.*incomplete.*DeepseekV4MtpForCausalLM"):
        DeepseekV4DSparkConfig.from_target_config({**tiny_dspark_config(), "dspark_target_layer_ids": None})


# -- the block size ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [4, 7, 1000])
def test_a_block_size_other_than_the_releases_is_refused_at_load(release, block):
    with pytest.raises(MtpCheckpointError, match=r"takes dspark_block_size=5 from the release, not "
                       rf"dspark_block_size={block}.*trained.*num_assistant_tokens=k"):
        DeepseekV4DSparkForCausalLM.from_pretrained(release[0], dspark_block_size=block)
    assert DeepseekV4DSparkForCausalLM.from_pretrained(release[0], dspark_block_size=5).block_size == 5


def test_a_block_longer_than_the_window_is_refused_with_the_reason(tmp_path, release):
    window = release[1]["sliding_window"]
    path = variant(tmp_path, release, config_edit=lambda c: c.update(dspark_block_size=1000))
    with pytest.raises(ValueError, match=rf"`dspark_block_size`=1000 exceeds `sliding_window`={window}: no DSpark "
                       r"drafts a block longer than the context window.*num_assistant_tokens=k"):
        DeepseekV4DSparkForCausalLM.from_pretrained(path)
    cfg = tiny_dspark_config(**SMALL)
    assert DeepseekV4DSparkConfig.from_target_config({**cfg, "dspark_block_size": window}).dspark_block_size == window
    with pytest.raises(ValueError, match="exceeds `sliding_window`"):
        DeepseekV4DSparkConfig.from_target_config({**cfg, "dspark_block_size": window + 1})


# -- binding ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layers", [2, 4, 8])
def test_binding_checks_the_target_layer_count(release, layers):
    path, cfg, _, _ = release
    dspark = DeepseekV4DSparkForCausalLM.from_pretrained(path)
    other = target_of(cfg, num_hidden_layers=layers, layer_types=None, mlp_layer_types=None)
    pattern = (rf"{NAME} does not match the target model: num_target_layers: draft 3 \(it reads the outputs of "
               rf"target layers \[0, 1, 2\]\) vs target {layers}\. Load the drafter from the same DeepSeek-V4 release")
    with pytest.raises(ValueError, match=pattern):
        dspark.bind(other)
    with pytest.raises(ValueError, match=pattern):
        DeepseekV4DSparkForCausalLM.from_pretrained(path, target_model=other)
    assert not dspark.is_bound and "generate" not in other.__dict__
    assert dspark.bind(target_of(cfg)).is_bound  # the release's own layer count binds


# -- files that are not there -------------------------------------------------------------------------------


@pytest.mark.tf_internals
@pytest.mark.parametrize("local_files_only", [False, True])
def test_offline_a_release_not_in_the_cache_says_so(tmp_path, local_files_only):
    """Offline (tests run with HF_HUB_OFFLINE=1), a repo id the cache does not hold: not "no drafter here"."""
    from huggingface_hub import constants

    assert constants.HF_HUB_OFFLINE or local_files_only  # never reach the network from a test
    kw = dict(cache_dir=tmp_path / "empty", local_files_only=local_files_only)
    for load in (load_drafter, DeepseekV4DSparkForCausalLM.from_pretrained, DeepseekV4MtpForCausalLM.from_pretrained):
        with pytest.raises(MtpCheckpointError, match=r"Cannot read config\.json of " + RELEASE + r": offline mode is "
                           r"on.*not in the local cache.*hf download " + RELEASE) as err:
            load(RELEASE, **kw)
        assert "No drafter" not in str(err.value)


def hub_cache(root: Path, repo: str, files: Path) -> Path:
    """A Hugging Face cache under ``root`` holding ``files`` as ``repo``'s main revision (no record of absent files)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    entry = root / f"models--{repo.replace('/', '--')}"
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(commit)
    shutil.copytree(files, entry / "snapshots" / commit)
    return root


@pytest.mark.tf_internals
def test_offline_a_cached_release_and_a_cached_single_file_drafter_load(tmp_path, release):
    """The other side of the offline rule: what the cache holds loads, and a single-file drafter whose index the
    cache has no record of is not refused as unreachable."""
    path, cfg, _, _ = release
    want = DeepseekV4DSparkForCausalLM.from_pretrained(path)
    cache = hub_cache(tmp_path / "hub", "org/dspark", path)
    got = load_drafter("org/dspark", cache_dir=cache)
    want.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved" / "model.safetensors.index.json").exists()
    saved = load_drafter("org/saved", cache_dir=hub_cache(tmp_path / "hub2", "org/saved", tmp_path / "saved"))
    for model in (got, saved):
        assert type(model) is DeepseekV4DSparkForCausalLM
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), want.state_dict().values()))


@pytest.mark.parametrize("shard, pattern", [
    ("model-00002-of-00002.safetensors", r"the index places the drafter's `mtp\.\*` tensors in it"),
    ("model-00001-of-00002.safetensors", r"it holds embed\.weight, read when no `target_model=` is given"),
], ids=["mtp_shard", "embed_shard"])
def test_a_local_copy_missing_a_shard_names_it(tmp_path, release, shard, pattern):
    path = Path(shutil.copytree(release[0], tmp_path / "copy"))
    (path / shard).unlink()
    for load in (DeepseekV4DSparkForCausalLM.from_pretrained, load_drafter):
        with pytest.raises(MtpCheckpointError, match=rf"{shard} \({pattern}\) is missing from the local directory "
                           rf"{path}: the copy is incomplete") as err:
            load(path)
        assert "huggingface.co" not in str(err.value)


# -- use_mtp=True and repeated loads -----------------------------------------------------------------------


@pytest.mark.tf_internals
def test_loading_the_same_release_again_replaces_the_earlier_copy(release, caplog):
    path, cfg, _, _ = release
    target = target_of(cfg)
    first = load_drafter(path, target_model=target)
    caplog.set_level(logging.WARNING)
    second = load_drafter(path, target_model=target)
    assert second.is_bound and not first.is_bound
    assert "Unbound an earlier " + NAME in caplog.text
    out = target.generate(IDS, use_mtp=True, max_new_tokens=4)  # drafts with the one copy bound
    assert second.last_generation_stats is not None and first.last_generation_stats is None
    assert torch.equal(out, target.generate(IDS, max_new_tokens=4))
    with pytest.raises(ValueError, match=NAME + r" is not bound to a target \(a later copy of it, loaded from "):
        target.generate(IDS, assistant_model=first, max_new_tokens=3)
    first.bind(target)  # the stated fix: bind the earlier copy again (the later one goes)
    assert first.is_bound and not second.is_bound


@pytest.mark.tf_internals
def test_use_mtp_with_several_drafters_names_them_and_with_none_says_to_bind_one(release):
    path, cfg, _, _ = release
    target = target_of(cfg)
    dspark = load_drafter(path, target_model=target)
    built = DeepseekV4DSparkForCausalLM(DeepseekV4DSparkConfig.from_target_config(cfg)).bind(target)  # no checkpoint
    with pytest.raises(ValueError, match=rf"2 are bound: {NAME} \({path}\), {NAME} \(built from a config\)"
                       r".*Pass `assistant_model=drafter`.*unbind\(\)"):
        target.generate(IDS, use_mtp=True, max_new_tokens=3)
    dspark.unbind()
    built.unbind()
    patching.record(target, create=True)  # a target we hold a record on (a graphed one) with no drafter bound
    with pytest.raises(ValueError, match=r"none is: load one with `load_drafter\(repo, target_model=target\)` or "
                       r"call `drafter\.bind\(target\)`"):
        _drafter_of_call(target, {"use_mtp": True})
