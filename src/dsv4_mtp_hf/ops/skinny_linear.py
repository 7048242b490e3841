"""``dsv4_mtp::skinny_linear`` / ``_cat`` / ``_sum`` -- dense projections of a few rows.

A draft step multiplies 1-16 rows (batch 1/4/16 x one token; ``h_proj`` sees 4 streams per
token) by the MTP's dense bf16 weights: ``e_proj``/``h_proj`` 4096x4096, ``wq_a`` 1024x4096 and
``wkv`` 512x4096 (same input), ``wq_b`` 32768x1024, the grouped ``wo_a`` 8 x (1024x4096),
``wo_b`` 4096x8192, the shared expert's ``w1``/``w3`` 2048x4096 (same input) and ``w2``
4096x2048.  At these sizes a projection is a pure weight stream: cuBLAS picks split-K GEMM
kernels plus a reduction launch (~133 us per step for ~80 us of bytes).  The CUDA
registration (``ops/triton/skinny_linear_triton.py``) streams each weight once in one launch
(two when N is too small to fill the GPU without splitting K), with projections that read the
same input concatenated into one launch (``skinny_linear_cat``) -- each output element is the
same dot product, so fusing changes no math.  Measured on the H200 (``benchmarks/linear_op.py``):
on par with cuBLAS on the single 64 MB weights, 1.35-1.43x on the fused pairs (no split-K
reduction launches), -14 us per compiled + graphed batch-1 draft step.

* ``skinny_linear(x [M, G*K], weight [N, K], groups=G) -> [M, N]``: with ``G = 1`` exactly
  ``F.linear(x, weight)``; with ``G > 1`` the grouped projection ``out[:, g*N/G:(g+1)*N/G] =
  x[:, g*K:(g+1)*K] @ weight[g*N/G:(g+1)*N/G].T`` (DeepSeek's ``wo_a``).
* ``skinny_linear_cat(x [M, K], [w_0 [N_0, K], w_1 [N_1, K]]) -> [M, N_0 + N_1]`` = ``F.linear(x,
  cat(w))`` without materialising the concatenated weight.
* ``skinny_linear_sum(x0 [M, K0], w0 [N, K0], x1 [M/R, K1], w1 [N, K1]) -> [M, N]`` = ``x0 w0^T +
  x1 w1^T`` (row m of the second product from ``x1[m // R]``), both in one fp32 accumulator and
  rounded once: ``h_proj`` over the 4 streams plus ``e_proj`` of the token, one 67 MB stream
  instead of two cuBLAS split-K calls, their reductions and the add.

x and the weights share a dtype (bf16, fp16 or fp32); fp32 accumulation; the result has x's
dtype.  The references below are the source of truth (CPU, autograd); the layers route
through the ops only on CUDA, outside autograd, for at most ``MAX_ROWS`` rows
(:func:`use_skinny`), so the CPU path is plain ``F.linear`` as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ._kernels import register_triton_kernels

LIB = "dsv4_mtp"
MAX_ROWS = 16  # rows (batch x tokens) up to which the layers use the op on CUDA
DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the ops take
# What the layers route through the ops: bf16, the dtype measured faster than cuBLAS on the H200.  The fp32 kernel path (FMA dot) is correct but measured slower than
# cuBLAS on the small fp32 GEMVs, and fp16 is untimed: both keep F.linear in the layers.
ROUTED_DTYPES = (torch.bfloat16,)


def check_skinny_inputs(x: torch.Tensor, weights: Sequence[torch.Tensor], groups: int = 1) -> None:
    """Raise ``ValueError`` / ``TypeError`` for inputs the ops do not define."""
    if not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be a positive int, got {groups!r}")
    if len(weights) == 0:
        raise ValueError("skinny_linear needs at least one weight")
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    k = weights[0].shape[-1] if weights[0].dim() == 2 else None
    for w in weights:
        if w.dim() != 2:
            raise ValueError(f"weight must be [N, K], got shape {tuple(w.shape)}")
        if w.shape[1] != k:
            raise ValueError(f"concatenated weights must share K, got {[tuple(t.shape) for t in weights]}")
        if w.dtype != x.dtype:
            raise TypeError(f"x and weight must share a dtype, got {x.dtype} and {w.dtype}")
        if w.device != x.device:
            raise ValueError(f"x and weight must be on one device, got {x.device} and {w.device}")
    if x.dtype not in DTYPES:
        raise TypeError(f"skinny_linear supports {DTYPES}, got {x.dtype}")
    if groups > 1 and (len(weights) != 1 or weights[0].shape[0] % groups):
        raise ValueError(f"groups={groups} needs one weight whose rows divide into the groups, "
                         f"got {[tuple(t.shape) for t in weights]}")
    if x.shape[1] != groups * k:
        raise ValueError(f"x [M, K] = {tuple(x.shape)} does not match weight K = {k}"
                         + (f" x groups = {groups}" if groups > 1 else ""))


def skinny_linear_reference(x: torch.Tensor, weight: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """``F.linear(x, weight)``; grouped: the einsum of ``GroupedOutputProjection`` (``wo_a``)."""
    if groups == 1:
        return F.linear(x, weight)
    m, k = x.shape[0], weight.shape[1]
    w = weight.view(groups, -1, k)
    return torch.einsum("mgi,goi->mgo", x.view(m, groups, k), w).flatten(-2)


def skinny_linear_cat_reference(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, cat(weights))``, one ``F.linear`` per weight (no concatenated copy)."""
    return torch.cat([F.linear(x, w) for w in weights], dim=-1)


@torch.library.custom_op(f"{LIB}::skinny_linear", mutates_args=())
def skinny_linear_op(x: torch.Tensor, weight: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """Fallback registration (any device without a faster kernel): the reference math."""
    check_skinny_inputs(x, [weight], groups)
    return skinny_linear_reference(x, weight, groups)


@skinny_linear_op.register_fake
def _(x, weight, groups=1):
    check_skinny_inputs(x, [weight], groups)
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op(f"{LIB}::skinny_linear_cat", mutates_args=())
def skinny_linear_cat_op(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """Fallback registration: the reference math."""
    check_skinny_inputs(x, weights)
    return skinny_linear_cat_reference(x, weights)


@skinny_linear_cat_op.register_fake
def _(x, weights):
    check_skinny_inputs(x, weights)
    return x.new_empty(x.shape[0], sum(w.shape[0] for w in weights))


def check_skinny_sum_inputs(x0: torch.Tensor, w0: torch.Tensor, x1: torch.Tensor, w1: torch.Tensor) -> int:
    """Validate ``skinny_linear_sum``'s inputs; returns how many rows of ``x0`` share one row of ``x1``."""
    check_skinny_inputs(x0, [w0])
    check_skinny_inputs(x1, [w1])
    if w0.shape[0] != w1.shape[0]:
        raise ValueError(f"skinny_linear_sum adds two products of one width: w0 {tuple(w0.shape)}, w1 {tuple(w1.shape)}.")
    if x1.dtype != x0.dtype or x1.device != x0.device:
        raise ValueError(f"x0 and x1 must share dtype and device, got {x0.dtype}/{x0.device} and {x1.dtype}/{x1.device}.")
    if x1.shape[0] == 0 or x0.shape[0] % x1.shape[0]:
        raise ValueError(f"x0's rows ({x0.shape[0]}) must be a whole multiple of x1's ({x1.shape[0]}).")
    return x0.shape[0] // x1.shape[0]


def skinny_linear_sum_reference(x0: torch.Tensor, w0: torch.Tensor, x1: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
    """``x0 @ w0.T + x1 @ w1.T``, row ``m`` of the second product taken from ``x1[m // R]`` (``R`` rows
    of ``x0`` per row of ``x1``): both products and their sum in fp32, rounded once to x0's dtype."""
    r = check_skinny_sum_inputs(x0, w0, x1, w1)
    both = F.linear(x0.float(), w0.float()) + F.linear(x1.float(), w1.float()).repeat_interleave(r, dim=0)
    return both.to(x0.dtype)


@torch.library.custom_op(f"{LIB}::skinny_linear_sum", mutates_args=())
def skinny_linear_sum_op(x0: torch.Tensor, w0: torch.Tensor, x1: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
    """Fallback registration: the reference math."""
    return skinny_linear_sum_reference(x0, w0, x1, w1)


@skinny_linear_sum_op.register_fake
def _(x0, w0, x1, w1):
    check_skinny_sum_inputs(x0, w0, x1, w1)
    return x0.new_empty(x0.shape[0], w0.shape[0])


def mtp_dense_shapes(config) -> list[tuple[str, tuple[int, ...], int, int, torch.dtype]]:
    """The MTP's dense projections at ``config``'s size: ``(name, rows of each weight read in one
    launch, K, groups, dtype)``.  The router gate (fp32 math over the bf16 gate) and the mHC
    ``fn`` GEMVs (fp32) run inside their own fused ops (``moe_route``, ``hc_pre``/``hc_head``);
    they are listed for the benchmark."""
    d, h = config.hidden_size, config.num_attention_heads * config.head_dim
    g, i, n = config.o_groups, config.moe_intermediate_size, config.hc_mult
    bf16, f32 = torch.bfloat16, torch.float32
    return [
        ("e_proj, h_proj (each)", (d,), d, 1, bf16),
        ("wq_a+wkv", (config.q_lora_rank, config.head_dim), d, 1, bf16),
        ("wq_b", (h,), config.q_lora_rank, 1, bf16),
        ("wo_a (grouped)", (g * config.o_lora_rank,), h // g, g, bf16),
        ("wo_b", (d,), g * config.o_lora_rank, 1, bf16),
        ("shared w1+w3", (i, i), d, 1, bf16),
        ("shared w2", (d,), i, 1, bf16),
        ("router gate (fp32)", (config.n_routed_experts,), d, 1, f32),
        ("hc fn (fp32)", ((2 + n) * n,), n * d, 1, f32),
    ]


def use_skinny(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the layers route ``x [..., K]`` through the ops: CUDA, bf16 (``ROUTED_DTYPES``), at
    most ``MAX_ROWS`` rows, weights of x's dtype on x's device, no autograd (the ops have no backward)."""
    if not (x.is_cuda and x.dtype in ROUTED_DTYPES and x.dim() >= 1 and x.shape[-1] > 0):
        return False
    if x.numel() // x.shape[-1] > MAX_ROWS:
        return False
    if any(w.dtype != x.dtype or w.device != x.device or w.dim() != 2 for w in weights):
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)))


def linear_weights(x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``F.linear(x, w)`` for each bias-free weight (a tuple when several, the tensor when one):
    where :func:`use_skinny` holds, the weights in order two at a time, each pair one ``skinny_linear_cat``
    launch (the kernel streams at most two weights) and a last odd one a ``skinny_linear``; ``F.linear`` per
    weight otherwise (same dot products either way)."""
    if not use_skinny(x, *weights):
        out = tuple(F.linear(x, w) for w in weights)
    else:
        out = ()
        for pair in (weights[i : i + 2] for i in range(0, len(weights), 2)):
            if len(pair) == 1:
                out += (skinny_linear(x, pair[0]),)
            else:
                out += tuple(skinny_linear_cat(x, pair).split([w.shape[0] for w in pair], -1))
    return out[0] if len(out) == 1 else out


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """``x [..., G, K]`` x ``weight [G*N, K]`` grouped (``wo_a``) -> ``[..., G*N]``: one weight-streaming
    launch where :func:`use_skinny` holds, the einsum of the reference otherwise."""
    if use_skinny(x.flatten(-2), weight):
        return skinny_linear(x.flatten(-2), weight, groups)
    return torch.einsum("...gi,goi->...go", x, weight.view(groups, -1, weight.shape[-1])).flatten(-2)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """``x [..., G*K]`` x ``weight [N, K]`` -> ``[..., N]`` through ``dsv4_mtp::skinny_linear``
    (any leading dims; the op sees ``[M, G*K]``)."""
    lead = x.shape[:-1]
    out = skinny_linear_op(x.reshape(-1, x.shape[-1]), weight, groups)
    return out.view(*lead, weight.shape[0])


def skinny_linear_cat(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """``x [..., K]`` -> ``[..., sum N_i]`` = ``F.linear(x, cat(weights))`` in one op."""
    lead = x.shape[:-1]
    out = skinny_linear_cat_op(x.reshape(-1, x.shape[-1]), list(weights))
    return out.view(*lead, out.shape[-1])


def skinny_linear_sum(x0: torch.Tensor, w0: torch.Tensor, x1: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
    """``x0 [..., R, K0] @ w0.T + (x1 [..., K1] @ w1.T)`` broadcast over the ``R`` axis -> ``[..., R, N]``
    in one op (``x1``'s leading dims are ``x0``'s without the ``R`` axis): the MTP's
    ``h_proj(hnorm(streams)) + e_proj(enorm(embedding))``."""
    if x0.shape[:-2] != x1.shape[:-1]:
        raise ValueError(f"x1 {tuple(x1.shape)} must have x0 {tuple(x0.shape)}'s leading dims without the stream axis.")
    out = skinny_linear_sum_op(x0.reshape(-1, x0.shape[-1]), w0, x1.reshape(-1, x1.shape[-1]), w1)
    return out.view(*x0.shape[:-1], w0.shape[0])


def register_cuda_kernels() -> bool:
    """Register the Triton kernels behind ``dsv4_mtp::skinny_linear(_cat)`` (on import when CUDA is present)."""
    return register_triton_kernels("skinny_linear_triton", "dsv4_mtp::skinny_linear")

if torch.cuda.is_available():
    register_cuda_kernels()
