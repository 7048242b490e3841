"""The V4 target's attention for a decode step of ``B`` sequences, ``n`` rows each (design §6): the sliding K=V
window plus the compressed entries (HCA: every closed entry; CSA: the lightning indexer's top-k), on
transformers' ``DeepseekV4Attention`` modules (referenced, never copied) and the sequences' fixed-shape state.

The state (``target_runtime/batched_state.py``, a slot per sequence) is read and written in place: the window
ring ``[B, W - 1 + max_rollback, d]`` (position ``p`` in slot ``p % R``) and per compressor stream the raw-row
rings and the entries (``dsv4_mtp::compressor_step``).  The rest is a function of the lengths ``L [B]`` (a device
tensor), so a step's shapes depend only on ``B`` and its row count ``n``, and a rollback only moves ``L``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.compressed_attention import compressed_attention
from ..ops.compressor import closing_windows, compressor_step
from ..ops.indexer import indexer_topk
from .linear import project, project_grouped
from .norms import RMSNorm, rms_normalize
from .rope import apply_rope, rotary_tables

_CSA = "compressed_sparse_attention"


class CompressorStream(nn.Module):
    """One compressor stream's weights, referenced from transformers' compressor (CSA / HCA) or CSA indexer: the
    raw rows' projections, the window position bias, the entries' norm and RoPE."""

    def __init__(self, module: nn.Module, overlap: bool, eps: float):
        super().__init__()
        self.kv_proj, self.gate_proj, self.position_bias = module.kv_proj, module.gate_proj, module.position_bias
        self.norm, self.rotary_emb = RMSNorm.of(module.kv_norm, eps), module.rotary_emb
        self.rate, self.overlap, self.eps = module.compress_rate, overlap, eps

    def step(self, kv: torch.Tensor, gate: torch.Tensor, state, length: torch.Tensor) -> torch.Tensor:
        """Append the step's projected rows ``[B, n, c]`` to ``state`` (its rings and entries, in place) and
        compress the windows they close.  -> the entries ``[B, E + 1, d]``."""
        first, _ = closing_windows(length, kv.shape[1], self.rate)
        cos, sin = rotary_tables(self.rotary_emb, kv, first * self.rate, "compress")
        compressor_step(kv, gate, length, state.ring_kv, state.ring_gate, state.entries, self.position_bias,
                        self.norm.weight, cos, sin, self.rate, self.overlap, self.eps)
        return state.entries


class CompressedAttention(nn.Module):
    """transformers' ``DeepseekV4Attention.forward`` for ``n`` new rows of each of ``B`` sequences, on its modules
    and the sequences' state.  The projections that read the same row run together (``project``: q_a, kv and the
    compressor and indexer projections; q_b and the indexer's q_b), each format apart (FP8 and bf16)."""

    def __init__(self, attn: nn.Module, config):
        super().__init__()
        eps = config.rms_norm_eps
        self.num_heads, self.head_dim, self.o_groups = config.num_attention_heads, config.head_dim, config.o_groups
        self.window, self.scale, self.eps = config.sliding_window, attn.scaling, eps
        self.rope_type = attn.rope_layer_type
        self.q_a_proj, self.q_b_proj, self.kv_proj = attn.q_a_proj, attn.q_b_proj, attn.kv_proj
        self.o_a_proj, self.o_b_proj, self.sinks = attn.o_a_proj, attn.o_b_proj, attn.sinks
        self.q_a_norm, self.kv_norm = RMSNorm.of(attn.q_a_norm, eps), RMSNorm.of(attn.kv_norm, eps)
        comp, csa = attn.compressor, attn.layer_type == _CSA
        self.compressor = None if comp is None else CompressorStream(comp, csa, eps)
        self.indexer = CompressorStream(comp.indexer, True, eps) if csa else None
        if csa:
            ix = comp.indexer
            self.index_q_proj, self.index_weights_proj = ix.q_b_proj, ix.scorer.weights_proj
            self.index_heads, self.index_dim, self.index_topk = ix.num_heads, ix.head_dim, ix.index_topk
            self.index_scales = (ix.scorer.softmax_scale, ix.scorer.weights_scaling)

    def forward(self, x: torch.Tensor, position_embeddings: dict, state, length: torch.Tensor) -> torch.Tensor:
        """``x [B, n, D]``: each sequence's rows at positions ``length[b] .. length[b] + n - 1``;
        ``position_embeddings``: the model's ``{"main", "compress"}`` cos/sin ``[B, n, rope/2]``; ``state``: this
        layer's (``ring``, ``streams``), one slot per sequence; ``length [B]`` int64 on x's device.
        -> ``[B, n, D]``."""
        b, n = x.shape[:2]
        cos, sin = position_embeddings[self.rope_type]
        positions = length.view(b, 1) + torch.arange(n, device=x.device)  # [B, n]
        streams = []
        for s in (self.compressor, self.indexer):
            streams += [] if s is None else [s.kv_proj, s.gate_proj]
        extra = [self.index_weights_proj] if self.indexer is not None else []
        q_lat, kv, *raw = project(x, self.q_a_proj, self.kv_proj, *streams, *extra)
        q_res = self.q_a_norm(q_lat)
        if self.indexer is not None:
            q, index_q = project(q_res, self.q_b_proj, self.index_q_proj)
        else:
            q, index_q = project(q_res, self.q_b_proj), None
        q = rms_normalize(q.view(b, n, self.num_heads, self.head_dim), self.eps)
        q = apply_rope(q, cos.unsqueeze(2), sin.unsqueeze(2))
        kv = apply_rope(self.kv_norm(kv), cos, sin)
        entries = picks = None
        if self.compressor is not None:
            entries = self.compressor.step(raw[0], raw[1], state.streams["compressor"], length)
            if self.indexer is not None:  # CSA: the indexer's top-k entries per row; HCA: every closed entry
                index_entries = self.indexer.step(raw[2], raw[3], state.streams["indexer"], length)
                picks = self._picks(index_q, raw[4], index_entries, positions, position_embeddings["compress"])
        rate = 0 if entries is None else self.compressor.rate
        out = compressed_attention(q, kv, state.ring, length, entries, picks, self.sinks, self.scale, self.window,
                                   rate)  # [B, n, H, d]
        self._write_ring(kv, state.ring, length)
        # K=V carried RoPE into the output: undone at the query's position (as transformers does)
        out = apply_rope(out, cos.unsqueeze(2), sin.unsqueeze(2), inverse=True)
        return project(project_grouped(out.reshape(b, n, self.o_groups, -1), self.o_a_proj), self.o_b_proj)

    @staticmethod
    def _write_ring(kv: torch.Tensor, ring: torch.Tensor, length: torch.Tensor) -> None:
        """The step's rows into the window ring (after the attention read it: the last row of a long step takes the
        slot of the first row's oldest key)."""
        b, n, slots = kv.shape[0], kv.shape[1], ring.shape[1]
        kept = min(n, slots)
        at = (length.view(b, 1) + n - kept + torch.arange(kept, device=kv.device)) % slots  # [B, kept]
        ring.index_put_((torch.arange(b, device=kv.device).view(b, 1), at), kv[:, n - kept:])

    def _picks(self, index_q, index_weights, index_entries, positions, compress_pe):
        """CSA: the indexer's top-k entries of each row ``[B, n, k]`` (``-1``: none; the real picks first)."""
        b, n = index_q.shape[:2]
        cos, sin = compress_pe
        q = apply_rope(index_q.view(b, n, self.index_heads, self.index_dim), cos.unsqueeze(2), sin.unsqueeze(2))
        return indexer_topk(q, index_entries, index_weights, positions, self.indexer.rate, self.index_topk,
                            *self.index_scales)
