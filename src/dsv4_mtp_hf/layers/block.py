"""The layer every DeepSeek-V4 drafter is made of: one V4 decoder layer wrapped in mHC (design §2)."""

from __future__ import annotations

from torch import nn

from .attention import MtpAttention
from .hyper_connection import HyperConnection, hc_post
from .moe import MtpMoE
from .norms import RMSNorm


class DeepseekV4DraftBlock(nn.Module):
    """One V4 decoder layer (sliding-window attention with sinks, score-routed FP4 MoE) wrapped in mHC:
    ``hc_pre -> attn_norm -> attention -> hc_post``, then ``hc_pre -> ffn_norm -> MoE -> hc_post``, on the
    streams ``[B, S, hc_mult, D]``."""

    def __init__(self, config):
        super().__init__()
        hc = (config.hc_mult, config.hidden_size, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MtpAttention(config)
        self.mlp = MtpMoE(config)

    def forward(self, streams, cos, sin, positions, cache=None, attention_backend=None, attention_plans=None,
                visible=None):
        """``visible``: the attention's key rule when it is not the causal sliding window (see
        :meth:`MtpAttention.forward`)."""
        collapsed, post, comb = self.attn_hc(streams)
        attn = self.self_attn(self.input_layernorm(collapsed), cos, sin, positions, cache, attention_backend,
                              attention_plans, visible)
        streams = hc_post(attn, streams, post, comb)
        collapsed, post, comb = self.ffn_hc(streams)
        ffn = self.mlp(self.post_attention_layernorm(collapsed))
        return hc_post(ffn, streams, post, comb)
