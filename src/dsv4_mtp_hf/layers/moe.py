"""The V4 MoE (design §2): sqrtsoftplus router, packed FP4 routed experts, one shared expert.
:class:`MtpMoE` is the drafters' (its own weights); :class:`SparseMoE` runs the target's MoE block on
its own modules, with the hash routing of its first layers."""

import torch
from torch import nn

from .. import fp4
from ..ops.fp4_moe import clamped_swiglu, fp4_moe
from ..ops.moe_route import hash_route, moe_route
from ..ops.mtp_moe import mtp_moe
from .linear import fp8_block, plain_linear, project, unhooked


class Router(nn.Module):
    """``s = sqrt(softplus(W_g h))`` in fp32; top-k of ``s + bias`` (bias selects only);
    weights = ``s`` at the chosen experts, renormalised, times the routed scaling factor."""

    def __init__(self, config):
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Buffer(torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h ``[T, D]`` -> (weights ``[T, k]`` fp32, expert ids ``[T, k]``); fused on CUDA."""
        return moe_route(h, self.weight, self.e_score_correction_bias, self.top_k, self.routed_scaling_factor,
                         self.norm_topk_prob)


class FP4Experts(nn.Module):
    """All routed experts, packed FP4 exactly as on disk (``fp4.py``); only the experts a
    token uses are ever decoded.  Global NVFP4 scales are kept as int32 bit patterns so
    that ``model.to(dtype)`` can never round them (``.view(torch.float32)`` reads them)."""

    def __init__(self, config):
        super().__init__()
        self.format = fp4.get_format(config.expert_format)
        self.swiglu_limit = float(config.swiglu_limit)
        e, d, i, g = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size, self.format.group_size
        self.num_experts, self.hidden_size, self.intermediate_size = e, d, i
        u8 = dict(dtype=torch.uint8)
        self.w13_weight = nn.Buffer(torch.zeros(e, 2 * i, d // 2, **u8))
        self.w13_scale = nn.Buffer(torch.zeros(e, 2 * i, d // g, **u8))
        self.w13_global_bits = nn.Buffer(torch.ones(e, 2, dtype=torch.float32).view(torch.int32).clone())
        self.w2_weight = nn.Buffer(torch.zeros(e, d, i // 2, **u8))
        self.w2_scale = nn.Buffer(torch.zeros(e, d, i // g, **u8))
        self.w2_global_bits = nn.Buffer(torch.ones(e, dtype=torch.float32).view(torch.int32).clone())

    @property
    def w13_global(self) -> torch.Tensor:
        return self.w13_global_bits.view(torch.float32)

    @property
    def w2_global(self) -> torch.Tensor:
        return self.w2_global_bits.view(torch.float32)

    @torch.no_grad()
    def set_expert(self, e: int | slice, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> None:
        """Quantise dense ``w1/w3 [I, D]`` and ``w2 [D, I]`` into slot ``e`` (or, with a slice, a stack
        ``[n, I, D]`` / ``[n, D, I]`` into those slots)."""
        p1, s1, g1 = fp4.quantize_fp4(w1, self.format)
        p3, s3, g3 = fp4.quantize_fp4(w3, self.format)
        p2, s2, g2 = fp4.quantize_fp4(w2, self.format)
        self.w13_weight[e] = torch.cat([p1, p3], dim=-2).to(self.w13_weight.device)
        self.w13_scale[e] = torch.cat([s1, s3], dim=-2).to(self.w13_scale.device)
        self.w13_global_bits[e] = torch.stack([g1, g3], dim=-1).view(torch.int32).to(self.w13_global_bits.device)
        self.w2_weight[e] = p2.to(self.w2_weight.device)
        self.w2_scale[e] = s2.to(self.w2_scale.device)
        self.w2_global_bits[e] = g2.view(torch.int32).to(self.w2_global_bits.device)

    def dequantized(self, e: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense ``(w13 [2I, D], w2 [D, I])`` of expert ``e`` (tests and oracles)."""
        w13 = fp4.dequantize_fp4(self.w13_weight[e], self.w13_scale[e], self.format)
        w13 = w13 * self.w13_global[e].repeat_interleave(self.intermediate_size).unsqueeze(-1)
        w2 = fp4.dequantize_fp4(self.w2_weight[e], self.w2_scale[e], self.format, self.w2_global[e])
        return w13.to(dtype), w2.to(dtype)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return fp4_moe(
            x, ids, weights.float(), self.w13_weight, self.w13_scale, self.w13_global,
            self.w2_weight, self.w2_scale, self.w2_global, self.format.name, self.swiglu_limit,
        )

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, format={self.format.name}"


class SharedExpert(nn.Module):
    """SwiGLU with V4's asymmetric clamp: gate clipped above only, up clipped both ways."""

    def __init__(self, config):
        super().__init__()
        d, i = config.hidden_size, config.moe_intermediate_size
        self.limit = config.swiglu_limit
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)

    @classmethod
    def of(cls, mlp: nn.Module, limit: float) -> "SharedExpert":
        """Ours on another shared expert's projections (transformers' ``DeepseekV4MLP``: ``nn.Linear`` or FP8
        modules), referenced, not copied."""
        ours = cls.__new__(cls)
        nn.Module.__init__(ours)
        ours.limit, ours.gate_proj, ours.up_proj, ours.down_proj = limit, mlp.gate_proj, mlp.up_proj, mlp.down_proj
        return ours

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, self.gate_proj, self.up_proj)  # one launch on CUDA for a few rows
        return project(clamped_swiglu(gate, up, self.limit).to(x.dtype), self.down_proj)

    def fp8_weights(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """``(w1, w3, w2, s1, s3, s2)`` when the expert is three unhooked FP8 block projections (a release's,
        ``target_runtime/fp8_linears.py``) and no gradient is wanted, else None."""
        mods = (self.gate_proj, self.up_proj, self.down_proj)
        if not (unhooked(self) and all(fp8_block(m) for m in mods)) or torch.is_grad_enabled() and x.requires_grad:
            return None
        return tuple(m.weight for m in mods) + tuple(m.weight_scale_inv for m in mods)

    def plain_weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(w1, w3, w2)`` when the expert is three plain bias-free ``nn.Linear`` and no gradient
        is wanted (``ops.mtp_moe.shared_expert`` then computes exactly this module), else None."""
        mods = (self.gate_proj, self.up_proj, self.down_proj)
        if not (unhooked(self) and all(plain_linear(m) for m in mods)):
            return None
        if torch.is_grad_enabled() and (x.requires_grad or any(m.weight.requires_grad for m in mods)):
            return None
        return tuple(m.weight for m in mods)


class MtpMoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate = Router(config)
        self.experts = FP4Experts(config)
        self.shared_experts = SharedExpert(config) if config.n_shared_experts else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, h.shape[-1])
        shared = self._overlap_weights(flat)
        if shared is not None:  # CUDA: the shared expert overlaps the router and routed kernels (same values)
            g, e = self.gate, self.experts
            routed, shared = mtp_moe(
                flat, g.weight, g.e_score_correction_bias, g.top_k, g.routed_scaling_factor, g.norm_topk_prob,
                e.w13_weight, e.w13_scale, e.w13_global, e.w2_weight, e.w2_scale, e.w2_global, e.format.name,
                e.swiglu_limit, *shared,
            )
            return (routed + shared).view_as(h)
        weights, ids = self.gate(flat)
        out = self.experts(flat, weights, ids).view_as(h)
        if self.shared_experts is not None:
            out = out + self.shared_experts(h)
        return out

    def _overlap_weights(self, flat: torch.Tensor):
        """The shared expert's weights when ``dsv4_mtp::mtp_moe`` computes exactly what the modules
        would: CUDA, a shared expert, no hooks or replaced forwards on the router or the experts
        (a hook must still fire), no gradient wanted; None otherwise (the modules run)."""
        if self.shared_experts is None or not flat.is_cuda or not (unhooked(self.gate) and unhooked(self.experts)):
            return None
        if torch.is_grad_enabled() and (flat.requires_grad or self.gate.weight.requires_grad):
            return None
        return self.shared_experts.plain_weights(flat)


class SparseMoE(nn.Module):
    """The target's MoE block (transformers' ``DeepseekV4SparseMoeBlock``) on its own modules, referenced: the
    router (score-routed, or by token id in the first ``hash_moe`` layers: ``tid2eid[input_ids]``), the routed
    experts and the shared expert.  Packed FP4 experts (``experts.fp4``, ``pack_fp4_experts``) with a plain or
    FP8 shared expert run as one ``dsv4_mtp::mtp_moe`` (the shared expert beside the routed half on CUDA);
    otherwise the routing ops, the experts module's own implementation and the shared expert."""

    def __init__(self, mlp: nn.Module, config):
        super().__init__()
        self.gate, self.experts = mlp.gate, mlp.experts
        self.shared_experts = SharedExpert.of(mlp.shared_experts, config.swiglu_limit)
        self.is_hash = bool(getattr(mlp, "is_hash", False))
        self.top_k, self.routed_scaling_factor = config.num_experts_per_tok, config.routed_scaling_factor

    def route(self, flat: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights ``[T, k]`` fp32, expert ids ``[T, k]``), as transformers' router picks them (in fp32)."""
        g = self.gate
        if self.is_hash:
            return hash_route(flat, g.weight, g.tid2eid, input_ids.reshape(-1), self.routed_scaling_factor)
        return moe_route(flat, g.weight, g.e_score_correction_bias, self.top_k, self.routed_scaling_factor, True)

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """``h [..., D]`` (the normed collapsed streams), ``input_ids`` its tokens ``[...]``."""
        flat = h.reshape(-1, h.shape[-1])
        fused = self._fused_args(flat, input_ids)
        if fused is not None:
            routed, shared = mtp_moe(*fused)
            return (routed + shared).view_as(h)
        weights, ids = self.route(flat, input_ids)
        # transformers' routers hand the experts weights in the activations' dtype
        return self.experts(flat, ids, weights.to(flat.dtype)).view_as(h) + self.shared_experts(h)

    def _fused_args(self, flat: torch.Tensor, input_ids: torch.Tensor) -> tuple | None:
        """``dsv4_mtp::mtp_moe``'s arguments when it computes exactly what the modules would: packed experts, a
        plain or FP8 shared expert, no hooks on the experts (a hook must still fire), no gradient wanted; else None.
        The router module is never called (its weights are routed by our ops, in fp32) on either path."""
        packed = getattr(self.experts, "fp4", None)
        if packed is None or not (unhooked(self.experts) and unhooked(packed)):
            return None
        if torch.is_grad_enabled() and (flat.requires_grad or self.gate.weight.requires_grad):
            return None
        s = self.shared_experts
        shared = s.plain_weights(flat) or s.fp8_weights(flat)
        if shared is None:
            return None
        g, e = self.gate, packed
        if self.is_hash:
            routing = (None, g.tid2eid, input_ids.reshape(-1))
        else:
            routing = (g.e_score_correction_bias, None, None)
        scales = shared[3:] if len(shared) == 6 else (None, None, None)
        return (flat, g.weight, routing[0], self.top_k, self.routed_scaling_factor, True, e.w13_weight, e.w13_scale,
                e.w13_global, e.w2_weight, e.w2_scale, e.w2_global, e.format.name, e.swiglu_limit, *shared[:3],
                *scales, routing[1], routing[2])
