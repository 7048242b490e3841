"""The MTP layer's attention: shared-KV MQA over a sliding window, with sinks (design §2); and
:func:`sink_attention`, the same softmax over any key groups (the target's window and compressed entries)."""

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import PagedMtpKVCache
from ..ops.attention import sliding_window_attention
from ..ops.attention_flashinfer import (
    FlashInferWindowPlans,
    select_attention_backend,
    sliding_window_attention_flashinfer,
)
from ..ops.skinny_linear import grouped_linear
from .linear import project
from .norms import RMSNorm, rms_normalize
from .rope import apply_rope

FP8_E4M3_MAX = 448.0


def fp8_roundtrip(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """DeepSeek's inference-time quantisation of the non-RoPE KV channels: e4m3 with a
    power-of-two scale per `block` values (an optional fidelity knob)."""
    xb = x.float().unflatten(-1, (-1, block))
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    s = torch.exp2(torch.ceil(torch.log2(amax / FP8_E4M3_MAX)))
    return ((xb / s).to(torch.float8_e4m3fn).float() * s).flatten(-2).to(x.dtype)


def sink_attention(q: torch.Tensor, sinks: torch.Tensor, scale: float,
                   *groups: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """transformers' eager V4 attention: one K=V head for every query head, a per-head sink logit in the
    softmax's denominator only.  ``q [b, H, S, d]``; each group ``(keys, visible)`` is keys ``[b, K, d]`` shared
    by the rows or ``[b, S, K, d]`` per row, and ``visible [b, S, K]``; one softmax over all groups' keys
    (masked logits ``-inf``; the sink keeps every row finite).  -> ``[b, S, H, d]``."""
    b, h, s, d = q.shape
    logits = []
    for keys, visible in groups:
        if keys.dim() == 3:  # [b, H * S, d] x [b, d, K]: one K=V head for all query heads, no broadcast copies
            lg = (torch.bmm(q.reshape(b, h * s, d), keys.transpose(1, 2)) * scale).view(b, h, s, -1)
        else:
            lg = (torch.matmul(q.transpose(1, 2), keys.transpose(-1, -2)) * scale).transpose(1, 2)
        logits.append(lg.masked_fill(~visible.unsqueeze(1), float("-inf")))
    combined = torch.cat(logits + [sinks.reshape(1, -1, 1, 1).expand(b, -1, s, -1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(groups[0][0].dtype)
    out, at = None, 0
    for keys, _ in groups:
        p, at = probs[..., at : at + keys.shape[-2]], at + keys.shape[-2]
        if keys.dim() == 3:
            part = torch.bmm(p.reshape(b, h * s, -1), keys).view(b, h, s, d).transpose(1, 2)
        else:
            part = torch.matmul(p.transpose(1, 2), keys)
        out = part if out is None else out + part
    return out


class GroupedOutputProjection(nn.Module):
    """``o [.., G, H*d/G]`` -> per-group ``wo_a`` -> ``[.., G * o_lora_rank]``.
    Weight stored as one ``[G * o_lora_rank, H*d/G]`` matrix (DeepSeek's ``wo_a``)."""

    def __init__(self, in_per_group: int, out_per_group: int, groups: int):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups * out_per_group, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return grouped_linear(x, self.weight, self.groups)


class MtpAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.window, self.o_groups = config.sliding_window, config.o_groups
        self.eps, self.kv_fp8_roundtrip = config.rms_norm_eps, config.kv_fp8_roundtrip
        self.rope_dim = config.qk_rope_head_dim
        self.scale = self.head_dim**-0.5
        d, h = config.hidden_size, self.num_heads * self.head_dim
        self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, h, bias=False)
        self.kv_proj = nn.Linear(d, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_a_proj = GroupedOutputProjection(h // config.o_groups, config.o_lora_rank, config.o_groups)
        self.o_b_proj = nn.Linear(config.o_groups * config.o_lora_rank, d, bias=False)
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.config = config  # read per call: `config.attention_backend` may change after loading
        self._flashinfer_plans = {}  # (device, dtype) -> FlashInferWindowPlans for calls without a drafter

    def attention_backend(self, dtype: torch.dtype, device: torch.device, rows: int, cache,
                          needs_grad: bool = False, requested: str | None = None) -> str:
        """``"flashinfer"`` or ``"reference"`` for a call of ``rows`` query rows (design §8):
        ``requested`` (default ``config.attention_backend``) "auto" picks FlashInfer where it runs,
        "flashinfer" raises where it does not."""
        return select_attention_backend(requested or self.config.attention_backend, dtype, device, self.head_dim,
                                        rows, isinstance(cache, PagedMtpKVCache), needs_grad)

    def new_flashinfer_plans(self, cache, steps: int, attention_backend: str | None = None) -> FlashInferWindowPlans | None:
        """Graph-safe FlashInfer plans for ``steps`` chained one-row steps on ``cache`` (what
        :class:`~dsv4_mtp_hf.generation.mtp_graph.GraphedDrafter` owns and passes to each call);
        None when such a step runs on the reference attention."""
        w = self.q_b_proj.weight
        if self.attention_backend(w.dtype, w.device, cache.batch_size, cache, requested=attention_backend) != "flashinfer":
            return None
        return FlashInferWindowPlans(self.num_heads, self.head_dim, self.window, self.scale, w.dtype, w.device,
                                     steps=steps, rows=cache.batch_size)

    def _dynamic_plans(self, q: torch.Tensor) -> FlashInferWindowPlans:
        key = (q.device, q.dtype)
        if key not in self._flashinfer_plans:
            self._flashinfer_plans[key] = FlashInferWindowPlans(self.num_heads, self.head_dim, self.window, self.scale,
                                                                q.dtype, q.device)
        return self._flashinfer_plans[key]

    def key_value(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The one K=V head of rows ``h [B, S, D]`` at their positions' ``cos``/``sin``: ``RoPE(kv_norm(wkv h))``
        (with DeepSeek's FP8 round trip of the non-RoPE channels when ``kv_fp8_roundtrip``)."""
        return self._key_value(project(h, self.kv_proj), cos, sin)

    def _key_value(self, kv, cos, sin):
        kv = apply_rope(self.kv_norm(kv), cos, sin)
        if self.kv_fp8_roundtrip:
            kv = torch.cat([fp8_roundtrip(kv[..., : -self.rope_dim]), kv[..., -self.rope_dim :]], dim=-1)
        return kv

    def forward(self, h, cos, sin, positions, cache=None, attention_backend: str | None = None,
                attention_plans: FlashInferWindowPlans | None = None, visible=None):
        """h ``[B, S, D]``; cos/sin ``[B, S, rope/2]`` at ``positions [B, S]``; ``cache`` an MTP cache
        or None.  ``attention_backend`` overrides ``config.attention_backend`` for this call;
        ``attention_plans``: the caller's FlashInfer plans (a drafter's per-step plans), else the
        layer plans each FlashInfer call itself.  ``visible``: ``(mask_positions [B, S], window)`` when the
        keys a row sees are not the causal window at its own position: row r sees the keys at
        ``(mask_positions[r] - window, mask_positions[r]]`` (DSpark's block: every row sees the context
        window and the whole block); runs the reference kernel path."""
        b, s, _ = h.shape
        q_lat, kv = project(h, self.q_a_proj, self.kv_proj)  # one launch on CUDA for a few rows
        q = project(self.q_a_norm(q_lat), self.q_b_proj).view(b, s, self.num_heads, self.head_dim)
        q = apply_rope(rms_normalize(q, self.eps), cos.unsqueeze(2), sin.unsqueeze(2))
        kv = self._key_value(kv, cos, sin)
        if cache is not None:
            kv, kv_positions = cache.update(kv)
            kv_positions = kv_positions.expand(b, -1)  # [L] (shared lengths) or [B, L] (paged)
        else:
            kv_positions = positions
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad)
        if visible is not None:
            mask_positions, window = visible
            o = sliding_window_attention(q, kv, mask_positions, kv_positions, self.sinks, window, self.scale)
        elif self.attention_backend(q.dtype, q.device, b * s, cache, needs_grad, attention_backend) == "flashinfer":
            # the paged cache's keys: W-1 held columns, then the S new ones at kv_positions[:, -s] onward
            plans = attention_plans if attention_plans is not None else self._dynamic_plans(q)
            o = sliding_window_attention_flashinfer(q, kv, kv_positions[:, -s], self.sinks, plans)
        else:
            o = sliding_window_attention(q, kv, positions, kv_positions, self.sinks, self.window, self.scale)
        o = apply_rope(o, cos.unsqueeze(2), sin.unsqueeze(2), inverse=True)
        o = self.o_a_proj(o.reshape(b, s, self.o_groups, -1))
        return project(o, self.o_b_proj)
