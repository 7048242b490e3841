import pytest
import torch

from dsv4_mtp_hf import DeepseekV4MtpConfig, DeepseekV4MtpForCausalLM, MtpKVCache

from .helpers import CONFIGS, tiny_pair, tiny_target_config


SEED = 8


@pytest.fixture(autouse=True)
def _seeded():
    """Draws from torch's global generator are seeded here (replay a failure with this seed)."""
    print(f"seed={SEED}")
    torch.manual_seed(SEED)


def inputs(mtp, b=2, s=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, mtp.config.vocab_size, (b, s), generator=g)
    hs = torch.randn(b, s, mtp.config.hc_mult, mtp.config.hidden_size, generator=g)
    return ids, hs


def test_mtp_forward_matches_the_spec_composition():
    target, mtp = tiny_pair()
    ids, hs = inputs(mtp, s=6)
    with torch.no_grad():
        out = mtp(ids, hs)
        e = mtp.e_proj(mtp.enorm(target.get_input_embeddings()(ids)))
        x = mtp.h_proj(mtp.hnorm(hs)) + e.unsqueeze(2)
        from dsv4_mtp_hf.layers.rope import rope_cos_sin

        pos = torch.arange(6).unsqueeze(0).expand(2, -1)
        cos, sin = rope_cos_sin(pos, mtp.config.qk_rope_head_dim, mtp.config.rope_theta)
        res = mtp.block(x, cos, sin, pos)
        logits = target.lm_head(mtp.norm(mtp.hc_head(res)))
    assert out.logits.shape == (2, 6, mtp.config.vocab_size)
    assert out.residual.shape == (2, 6, mtp.config.hc_mult, mtp.config.hidden_size)
    torch.testing.assert_close(out.residual, res)
    torch.testing.assert_close(out.logits, logits)


@pytest.mark.parametrize("chunks", [[1] * 20, [7, 1, 1, 11], [20], [3, 9, 8]])
def test_prefill_equals_cached_steps(chunks):
    _, mtp = tiny_pair()
    ids, hs = inputs(mtp, s=sum(chunks))  # window 8: crosses it
    with torch.no_grad():
        full = mtp(ids, hs).logits
        cache, outs, p = mtp.new_cache(), [], 0
        for n in chunks:
            outs.append(mtp(ids[:, p : p + n], hs[:, p : p + n], past_key_values=cache, use_cache=True).logits)
            p += n
    assert cache.get_seq_length() == sum(chunks)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)


def test_crop_then_re_extend_equals_a_cache_that_never_saw_the_rejected_rows():
    _, mtp = tiny_pair()
    ids, hs = inputs(mtp, s=30)
    other_ids, other_hs = inputs(mtp, s=30, seed=7)
    with torch.no_grad():
        full = mtp(ids, hs).logits
        cache = mtp.new_cache()
        mtp(ids[:, :15], hs[:, :15], past_key_values=cache)
        for drafted in (1, 3, 5, 16):  # rejected rows of a different sequence
            mtp(other_ids[:, :drafted], other_hs[:, :drafted], past_key_values=cache)
            cache.crop(15)
            assert cache.get_seq_length() == 15
        cache_neg = mtp.new_cache()
        mtp(ids[:, :18], hs[:, :18], past_key_values=cache_neg)
        cache_neg.crop(-3)  # the negative form transformers uses
        rest = mtp(ids[:, 15:], hs[:, 15:], past_key_values=cache).logits
        rest_neg = mtp(ids[:, 15:], hs[:, 15:], past_key_values=cache_neg).logits
    torch.testing.assert_close(rest, full[:, 15:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rest_neg, full[:, 15:], rtol=1e-5, atol=1e-5)


def test_cache_memory_is_bounded_by_window_plus_drafts():
    _, mtp = tiny_pair(max_draft_tokens=4)
    ids, hs = inputs(mtp, b=1, s=64)
    cache = mtp.new_cache()
    with torch.no_grad():
        for p in range(64):
            mtp(ids[:, p : p + 1], hs[:, p : p + 1], past_key_values=cache)
            assert cache.kv.shape[1] <= mtp.config.sliding_window - 1 + 4
    cache.crop(60)
    assert cache.get_seq_length() == 60
    with pytest.raises(ValueError, match="max_draft_tokens"):
        cache.crop(50)
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(61)
    cache.crop(0)  # transformers' convention: removes nothing (the same verb as on the target's cache)
    assert cache.get_seq_length() == 60


def test_bad_inputs_raise_errors_that_name_the_problem():
    target, mtp = tiny_pair()
    ids, hs = inputs(mtp, s=4)
    with pytest.raises(ValueError, match="hc_mult"):
        mtp(ids, hs[:, :, :2])
    with pytest.raises(ValueError, match="pre-hc_head residual"):
        mtp(ids, hs[:, :, 0])
    with pytest.raises(ValueError, match="hidden_states"):
        mtp(ids, hs[..., :-1])
    with pytest.raises(ValueError, match="vocab_size"):
        mtp(ids + mtp.config.vocab_size, hs)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        mtp(ids, hs, position_ids=torch.arange(4).unsqueeze(0) + mtp.config.max_position_embeddings)
    unbound = DeepseekV4MtpForCausalLM(mtp.config)
    with pytest.raises(RuntimeError, match="not bound"):
        unbound(ids, hs)
    with pytest.raises(RuntimeError, match="assistant_model"):
        mtp.generate(ids)


def test_binding_rejects_a_mismatched_target():
    from transformers import DeepseekV4ForCausalLM

    _, mtp = tiny_pair()
    for override in ({"vocab_size": 512}, {"hc_mult": 2}, {"hidden_size": 96}, {"rope_theta": 5000.0}):
        other = DeepseekV4ForCausalLM(tiny_target_config(**override))
        with pytest.raises(ValueError, match=next(iter(override))):
            mtp.bind(other)


def test_shared_embedding_and_head_are_referenced_not_copied():
    target, mtp = tiny_pair()
    assert mtp.get_input_embeddings() is target.get_input_embeddings()
    assert mtp.get_output_embeddings() is target.lm_head
    keys = mtp.state_dict().keys()
    assert not any("embed" in k or "lm_head" in k for k in keys)
    assert sum(p.numel() for p in mtp.parameters()) < sum(p.numel() for p in target.parameters())


def test_config_validation_and_json_round_trip(tmp_path):
    with pytest.raises(ValueError, match="group size"):
        DeepseekV4MtpConfig(hidden_size=4100)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        DeepseekV4MtpConfig(moe_intermediate_size=2050, expert_format="nvfp4")
    with pytest.raises(ValueError, match="expert_format"):
        DeepseekV4MtpConfig(expert_format="int4")
    with pytest.raises(ValueError, match="sqrtsoftplus"):
        DeepseekV4MtpConfig(scoring_func="softmax")
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        DeepseekV4MtpConfig.from_target_config(tiny_target_config(num_nextn_predict_layers=0))
    c = DeepseekV4MtpConfig.from_target_config(tiny_target_config(), expert_format="nvfp4")
    c.save_pretrained(tmp_path)
    c2 = DeepseekV4MtpConfig.from_pretrained(tmp_path)
    assert c2.to_dict() == c.to_dict()


def test_flash_sized_mtp_keeps_experts_packed_in_about_4gb():
    config = DeepseekV4MtpConfig.from_json_file(str(CONFIGS / "deepseek-v4-flash-mtp.json"))
    with torch.device("meta"):
        model = DeepseekV4MtpForCausalLM._from_config(config, dtype=torch.bfloat16)
    nbytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    experts = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if ".experts." in n)
    assert 3.3e9 < experts < 3.8e9  # 256 experts x 3 matrices x 2048x4096 at 4.25 bits (MXFP4)
    assert nbytes < 4.2e9, nbytes


def test_save_and_load_round_trip_is_bit_exact(tmp_path):
    target, mtp = tiny_pair(expert_format="nvfp4")
    mtp.save_pretrained(tmp_path)
    loaded = DeepseekV4MtpForCausalLM.from_pretrained(tmp_path, target_model=target)
    for (k, a), (k2, b) in zip(mtp.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and a.dtype == b.dtype and torch.equal(a, b), k
    ids, hs = inputs(mtp, s=5)
    with torch.no_grad():
        assert torch.equal(mtp(ids, hs).logits, loaded(ids, hs).logits)


def test_auto_classes_know_the_mtp(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    target, mtp = tiny_pair()
    mtp.save_pretrained(tmp_path)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), DeepseekV4MtpConfig)
    assert isinstance(AutoModelForCausalLM.from_pretrained(tmp_path), DeepseekV4MtpForCausalLM)


def test_mtp_kv_cache_rejects_a_batch_change():
    cache = MtpKVCache(8, 2)
    cache.update(torch.randn(2, 3, 16))
    with pytest.raises(ValueError, match="fresh cache"):
        cache.update(torch.randn(3, 1, 16))


def test_kv_fp8_roundtrip_quantises_only_the_non_rope_channels():
    from dsv4_mtp_hf.layers.attention import fp8_roundtrip

    x = torch.randn(3, 5, 128) * 3
    y = fp8_roundtrip(x)
    blocks = x.unflatten(-1, (-1, 64))
    scale = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(-1, keepdim=True) / 448.0)))
    codes = y.unflatten(-1, (-1, 64)) / scale
    assert torch.equal(codes, codes.to(torch.float8_e4m3fn).float())  # every value is e4m3 x a power of two
    assert 0 < (y - x).norm() / x.norm() < 0.05
    with pytest.raises(ValueError, match="blocks of 64"):
        tiny_pair(kv_fp8_roundtrip=True)  # head_dim 32: 24 non-RoPE channels
    wide = dict(head_dim=128, partial_rotary_factor=0.5)  # 64 RoPE + 64 non-RoPE channels
    target, mtp = tiny_pair(target_overrides=wide)
    _, fp8 = tiny_pair(target_overrides=wide, kv_fp8_roundtrip=True)
    fp8.bind(target)
    fp8.load_state_dict(mtp.state_dict())
    ids, hs = inputs(mtp, s=6)
    with torch.no_grad():
        a, b = mtp(ids, hs).logits, fp8(ids, hs).logits
    assert 0 < (a - b).norm() / a.norm() < 0.05  # a small perturbation, as e4m3 rounding should be


def test_long_prefill_attention_is_chunked_and_exact():
    from dsv4_mtp_hf.ops.attention import sliding_window_attention_reference as attn

    g = torch.Generator().manual_seed(0)
    held, s, h, d, w = 7, 300, 4, 32, 8
    q = torch.randn(2, s, h, d, generator=g)
    kv = torch.randn(2, held + s, d, generator=g)
    kv_pos = torch.arange(40 - held, 40 + s).expand(2, -1)
    q_pos = torch.arange(40, 40 + s).expand(2, -1)
    sinks = torch.randn(h, generator=g)
    full = attn(q, kv, q_pos, kv_pos, sinks, w, d**-0.5, query_chunk=None)
    for chunk in (1, 16, 100, 256):
        torch.testing.assert_close(attn(q, kv, q_pos, kv_pos, sinks, w, d**-0.5, query_chunk=chunk), full,
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("shape,rope_dim", [((2, 3, 4, 512), 64), ((2, 3, 96), 32), ((1, 2, 16), 16)])
def test_rope_per_channel_form_equals_the_slice_form(shape, rope_dim, inverse):
    """The form torch.compile traces (one expression per channel, no cat/stack, so it fuses with
    the norm before it) computes the same values as the eager slice form, bit for bit."""
    from dsv4_mtp_hf.layers.rope import _apply_rope_per_channel, apply_rope, rope_cos_sin

    gen = torch.Generator().manual_seed(sum(shape) + rope_dim)
    x = torch.randn(shape, generator=gen).bfloat16()
    cos, sin = rope_cos_sin(torch.randint(0, 1 << 20, shape[:2], generator=gen), rope_dim, 10000.0)
    if len(shape) == 4:
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    want = apply_rope(x, cos, sin, inverse)
    assert torch.equal(_apply_rope_per_channel(x, cos, sin, inverse), want)
    compiled = torch.compile(lambda x, c, s: apply_rope(x, c, s, inverse), fullgraph=True)
    torch.testing.assert_close(compiled(x, cos, sin), want, rtol=0, atol=0)
