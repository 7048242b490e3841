"""The V4 decoder layer: one block for every V4 layer we run (design §2, §6).

:class:`DeepseekV4Block` is the layer's residual structure -- ``hc_pre -> norm -> attention -> hc_post``,
then ``hc_pre -> norm -> MoE -> hc_post`` on the streams ``[B, S, hc_mult, D]`` -- over an attention and a
MoE sublayer.  The drafters (MTP, DSpark) are made of :class:`DeepseekV4DraftBlock`: the block with its own
weights, sliding-window attention and packed MoE.  The graphed target's decode step runs
:meth:`DeepseekV4Block.of_target_layer`: the block on a transformers ``DeepseekV4DecoderLayer``'s own
modules (referenced, never copied), with its compressed attention and its (hash-)routed MoE.
"""

from __future__ import annotations

from torch import nn

from .attention import MtpAttention
from .compressed_attention import CompressedAttention
from .hyper_connection import HyperConnection, hc_post
from .moe import MtpMoE, SparseMoE
from .norms import RMSNorm


class DeepseekV4Block(nn.Module):
    """One V4 decoder layer (module docstring).  ``forward(streams, *attention_args, mlp_kwargs=None,
    **attention_kwargs)``: the attention sublayer gets the normed collapsed rows and the arguments, the MoE
    the normed rows and ``mlp_kwargs``."""

    def __init__(self, attn_hc: nn.Module, ffn_hc: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.attn_hc, self.ffn_hc = attn_hc, ffn_hc
        self.input_layernorm, self.post_attention_layernorm = input_layernorm, post_attention_layernorm
        self.self_attn, self.mlp = self_attn, mlp

    @classmethod
    def of_target_layer(cls, layer: nn.Module, config) -> "DeepseekV4Block":
        """The block on transformers' ``DeepseekV4DecoderLayer`` ``layer`` (its Parameters and modules, FP8
        projections and packed experts as loaded): ``forward(streams, position_embeddings, state, length,
        mlp_kwargs={"input_ids": ids})`` is that layer's step of ``n`` rows on one sequence's fixed-shape state
        (:class:`~.compressed_attention.CompressedAttention`)."""
        eps = config.rms_norm_eps
        return cls(HyperConnection.of(layer.attn_hc, eps), HyperConnection.of(layer.ffn_hc, eps),
                   RMSNorm.of(layer.input_layernorm, eps), RMSNorm.of(layer.post_attention_layernorm, eps),
                   CompressedAttention(layer.self_attn, config), SparseMoE(layer.mlp, config))

    def forward(self, streams, *attention_args, mlp_kwargs: dict | None = None, **attention_kwargs):
        collapsed, post, comb = self.attn_hc(streams)
        attn = self.self_attn(self.input_layernorm(collapsed), *attention_args, **attention_kwargs)
        streams, collapsed, post, comb = self.ffn_hc.after(attn, streams, post, comb)
        return hc_post(self.mlp(self.post_attention_layernorm(collapsed), **(mlp_kwargs or {})), streams, post, comb)


class DeepseekV4DraftBlock(DeepseekV4Block):
    """The drafters' V4 layer: sliding-window attention with sinks and a score-routed FP4 MoE, its own weights."""

    def __init__(self, config):
        hc = (config.hc_mult, config.hidden_size, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)
        super().__init__(HyperConnection(*hc), HyperConnection(*hc), RMSNorm(config.hidden_size, config.rms_norm_eps),
                         RMSNorm(config.hidden_size, config.rms_norm_eps), MtpAttention(config), MtpMoE(config))

    def forward(self, streams, cos, sin, positions, cache=None, attention_backend=None, attention_plans=None,
                visible=None):
        """``visible``: the attention's key rule when it is not the causal sliding window (see
        :meth:`MtpAttention.forward`)."""
        return super().forward(streams, cos, sin, positions, cache, attention_backend, attention_plans, visible)
