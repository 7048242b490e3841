"""Our V4 block vs transformers' own `DeepseekV4DecoderLayer` (sliding attention,
score-routed MoE) on the same, dequantised weights."""

import pytest
import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from dsv4_mtp_hf.layers.rope import rope_cos_sin
from dsv4_mtp_hf.layers.block import DeepseekV4DraftBlock

from .helpers import randomize_, tiny_target_config
from dsv4_mtp_hf import DeepseekV4MtpConfig


def build_pair(expert_format, seed):
    torch.manual_seed(seed)
    tc = tiny_target_config(num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"])
    config = DeepseekV4MtpConfig.from_target_config(tc, expert_format=expert_format)
    ours = DeepseekV4DraftBlock(config)
    g = torch.Generator().manual_seed(seed)
    randomize_(ours, g)
    for e in range(config.n_routed_experts):
        i, d = config.moe_intermediate_size, config.hidden_size
        ours.mlp.experts.set_expert(e, torch.randn(i, d, generator=g) * 0.3, torch.randn(i, d, generator=g) * 0.3, torch.randn(d, i, generator=g) * 0.3)
    ref = hf.DeepseekV4DecoderLayer(tc, 0).float()
    sd = {k: v for k, v in ours.state_dict().items() if ".experts." not in k}
    w13, w2 = zip(*(ours.mlp.experts.dequantized(e) for e in range(config.n_routed_experts)))
    sd["mlp.experts.gate_up_proj"] = torch.stack(w13)
    sd["mlp.experts.down_proj"] = torch.stack(w2)
    missing, unexpected = ref.load_state_dict(sd, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return tc, config, ours.eval(), ref.eval()


@pytest.mark.tf_internals
@pytest.mark.parametrize("expert_format", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("seq_len", [1, 5, 8, 21])  # window is 8: lengths below, at and across it
def test_block_matches_transformers_decoder_layer(expert_format, seq_len):
    tc, config, ours, ref = build_pair(expert_format, seed=seq_len)
    b = 2
    x = torch.randn(b, seq_len, config.hc_mult, config.hidden_size)
    pos = torch.arange(seq_len).unsqueeze(0).expand(b, -1)
    cos, sin = rope_cos_sin(pos, config.qk_rope_head_dim, config.rope_theta)
    rotary = hf.DeepseekV4RotaryEmbedding(tc)
    pe = {"main": rotary(x, position_ids=pos, layer_type="main"), "compress": rotary(x, position_ids=pos, layer_type="compress")}
    delta = pos.unsqueeze(-1) - pos.unsqueeze(-2)
    mask = torch.zeros(b, 1, seq_len, seq_len).masked_fill(~((delta >= 0) & (delta < tc.sliding_window)).unsqueeze(1), float("-inf"))
    with torch.no_grad():
        want = ref(x, position_embeddings=pe, position_ids=pos, attention_mask=mask)
        got = ours(x, cos, sin, pos)
    assert want.abs().mean() > 0.1
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
