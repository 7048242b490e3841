"""Triton kernel behind ``dsv4_mtp::window_attention`` for one query row per sequence (a draft step).

Grid ``(B, H / block_h, NSPLIT)``: a program holds ``block_h`` query heads ``[block_h, d]`` of
one sequence and walks one contiguous range of ``keys_per_program`` keys in steps of
``block_l``: bf16 scores by MMA (fp32 accumulation, as the reference's fp32 products of bf16
values), the window mask from the positions, an online softmax in fp32 (finite -1e30 start,
so a fully masked range leaves a zero partial, never NaN), and ``p @ kv`` with the
probabilities rounded to bf16 (fp32 accumulation) -- the only rounding the reference does
not have, ~2**-9 per probability.  The keys are loaded once per step and serve as values too
(shared KV).

* ``NSPLIT == 1`` (``keys_per_program=0``: all keys in one program): the program adds the
  sink to the denominator and writes the output itself -- grid ``(B, H / block_h)``.
* ``NSPLIT > 1`` (flash-decoding): each program writes its partial (running max ``m``,
  denominator, unnormalised ``[block_h, d]`` fp32 accumulator) to a workspace, then the
  splits are combined in a fixed order (split 0, 1, ...: deterministic) with the sink in the
  denominator, output in q's dtype.  ``combine="ticket"``: the last program of each
  (sequence, head block) to arrive, by an acq_rel atomic ticket, combines (L2-only ``.cg``
  loads of the partials) and resets its ticket to 0 for the next call / graph replay -- one
  launch.  ``combine="kernel"``: a second small launch combines (also the fallback while a
  CUDA graph is being captured before any eager call has allocated the tickets).

``CONFIG`` holds the launch settings; ``"auto"`` picks from the shape (``pick_config``).
Fixed grid per shape, no host sync, nothing order-dependent: CUDA-graph safe and
deterministic.  The tickets are one zeroed int32 buffer per device shared by all calls, so
calls on one device must not run concurrently on different streams.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import torch
import triton
import triton.language as tl

from .persistent import persistent_zeros
from . import pdl
from .pdl import wait
from ..attention import check_window_attention_inputs, sliding_window_attention_reference, window_attention

BLOCK_H = 16  # the smallest head block (the MMA's M): kernel_takes needs a multiple of it
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # CPU debugging / tests: fp32 dots

# Launch settings; "auto" = pick_config's choice for the shape.
#   keys_per_program: keys per program (16, 32, 64, ...); 0 or None = all keys in one program
#                     (no split, no workspace: the single-kernel path)
#   block_h:          query heads per program (16, 32, 64; must divide H)
#   block_l:          keys per MMA step inside a program (16 .. keys_per_program)
#   combine:          "ticket" (last-arriving program, one launch) or "kernel" (second launch)
#   num_warps:        warps per program
CONFIG: dict = {"keys_per_program": "auto", "block_h": "auto", "block_l": "auto", "combine": "ticket",
                "num_warps": "auto"}


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    keys_per_program: int  # 0: all keys in one program
    block_h: int
    block_l: int
    combine: str
    num_warps: int

    def splits(self, length: int) -> int:
        return 1 if not self.keys_per_program else triton.cdiv(length, self.keys_per_program)


def pick_config(b: int, h: int, length: int, d: int) -> dict:
    """The default for a shape (H200, V4-Flash H=64 d=512 L=128, ``benchmarks/attention_op.py``):
    while the unsplit grid is small (B=1..4: 4-16 programs) split the keys in two ranges of 64
    with the ticket combine -- 7.4 µs at B=1 against 8.1 unsplit and 11.4 for the kernel before
    the split (32-key steps, 4 warps); finer splits (32 or 16 keys), wider head blocks or the
    second-launch combine were slower.  From 64 unsplit programs on (B=16) the split no longer
    pays (8.7 µs either way): one program per head block walks all keys, no workspace."""
    if b * (h // 16) >= 64 or length <= 64:
        return dict(keys_per_program=0, block_h=16)
    return dict(keys_per_program=64, block_h=16)


def resolve_config(b: int, h: int, length: int, d: int, config: dict | None = None) -> LaunchConfig:
    """``CONFIG`` overridden by ``config``, with each ``"auto"`` filled from :func:`pick_config`."""
    c = {**CONFIG, **(config or {})}
    unknown = set(c) - set(CONFIG)
    if unknown:
        raise ValueError(f"unknown window-attention setting(s) {sorted(unknown)}; known: {sorted(CONFIG)}.")
    auto = pick_config(b, h, length, d)
    for k, v in auto.items():
        if c[k] == "auto":
            c[k] = v
    kpp = int(c["keys_per_program"] or 0)
    if kpp and (kpp < 16 or kpp & (kpp - 1)):
        raise ValueError(f"keys_per_program={kpp} must be a power of two >= 16 (or 0: all keys in one program).")
    if kpp >= length:
        kpp = 0  # one range holds every key: the single-kernel path
    bh = int(c["block_h"])
    if bh not in (16, 32, 64) or h % bh:
        raise ValueError(f"block_h={bh} must be 16, 32 or 64 and divide the {h} heads; set "
                         "attention_triton.CONFIG['block_h'] to one that does (or 'auto').")
    bl = c["block_l"]
    if bl == "auto":  # 64-key steps (2 per 128 keys) beat 32 at d=512; [64, 1024] bf16 keys would crowd smem
        bl = 64 if d <= 512 else 32
        bl = min(bl, kpp) if kpp else bl
    if bl < 16 or bl & (bl - 1) or (kpp and bl > kpp):
        raise ValueError(f"block_l={bl} must be a power of two >= 16 and at most keys_per_program={kpp}.")
    if c["combine"] not in ("ticket", "kernel"):
        raise ValueError(f"combine={c['combine']!r} must be 'ticket' or 'kernel'.")
    nw = c["num_warps"]
    nw = (8 if bh * d >= 8192 else 4) if nw == "auto" else int(nw)  # [16, 512] on 4 warps spills (ptxas)
    return LaunchConfig(kpp, bh, bl, c["combine"], nw)


@triton.jit
def _combine(acc_ptr, m_ptr, den_ptr, sink_ptr, out_ptr, b, h, d, H, so_b, so_h,
             D: tl.constexpr, BLOCK_H: tl.constexpr, NSPLIT: tl.constexpr):
    """out[b, h] from the NSPLIT partials, split 0 first (a fixed order: deterministic).
    ``.cg``: the partials come from other programs of this launch, so read them from the L2."""
    row = b * NSPLIT * H + h  # [BLOCK_H] row of split 0 in the [B, NSPLIT, H] statistics
    sink = tl.load(sink_ptr + h).to(tl.float32)
    m = sink
    for i in tl.static_range(NSPLIT):
        m = tl.maximum(m, tl.load(m_ptr + row + i * H, cache_modifier=".cg"))
    den = tl.exp(sink - m)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    for i in tl.static_range(NSPLIT):
        w = tl.exp(tl.load(m_ptr + row + i * H, cache_modifier=".cg") - m)  # 0 for a fully masked split
        den += tl.load(den_ptr + row + i * H, cache_modifier=".cg") * w
        part = tl.load(acc_ptr + (row + i * H)[:, None].to(tl.int64) * D + d[None, :], cache_modifier=".cg")
        acc += part * w[:, None]
    out = acc / den[:, None]
    tl.store(out_ptr + b * so_b + h[:, None].to(tl.int64) * so_h + d[None, :], out.to(out_ptr.dtype.element_ty))


@triton.jit
def _step(q, kv_ptr, kvpos_ptr, qp, b, l0, l1, window, scale, skv_b, skv_l, skp_b, skp_l, m, den, acc, d,
          BLOCK_L: tl.constexpr, FP32: tl.constexpr):
    """Keys ``[l0, l0 + BLOCK_L) & [.., l1)`` into the online softmax state ``(m, den, acc)``."""
    j = l0 + tl.arange(0, BLOCK_L)
    ok = j < l1
    kv = tl.load(kv_ptr + b * skv_b + j[:, None].to(tl.int64) * skv_l + d[None, :], mask=ok[:, None], other=0.0)
    kp = tl.load(kvpos_ptr + b * skp_b + j.to(tl.int64) * skp_l, mask=ok, other=0)
    if FP32:  # the CPU interpreter: its dot misreads bf16 operands
        s = tl.dot(q.to(tl.float32), tl.trans(kv.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(kv))
    delta = qp - kp
    visible = ok & (delta >= 0) & (delta < window)
    s = tl.where(visible[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    den = den * alpha + tl.sum(p, axis=1)
    if FP32:
        acc = acc * alpha[:, None] + tl.dot(p, kv.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
    return m_new, den, acc


@triton.jit
def _window_attention_kernel(q_ptr, kv_ptr, qpos_ptr, kvpos_ptr, sink_ptr, out_ptr, acc_ptr, m_ptr, den_ptr,
                             ticket_ptr, L, keys_per_program, window, scale, H,
                             sq_b, sq_h, skv_b, skv_l, sqp_b, skp_b, skp_l, so_b, so_h,
                             D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, STEPS: tl.constexpr,
                             NSPLIT: tl.constexpr, TICKET: tl.constexpr, FP32: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sq_b + h[:, None].to(tl.int64) * sq_h + d[None, :])
    qp = tl.load(qpos_ptr + b * sqp_b)
    m = tl.full([BLOCK_H], -1e30, dtype=tl.float32)  # finite: a fully masked block leaves alpha = 1, p = 0
    den = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    l0 = split * keys_per_program
    l1 = tl.minimum(l0 + keys_per_program, L)
    if STEPS > 0:  # a split's few steps unrolled: q and the keys die after their last use (fewer registers)
        for i in tl.static_range(STEPS):
            m, den, acc = _step(q, kv_ptr, kvpos_ptr, qp, b, l0 + i * BLOCK_L, l1, window, scale, skv_b, skv_l,
                                skp_b, skp_l, m, den, acc, d, BLOCK_L, FP32)
    else:
        while l0 < l1:  # (a runtime-bounded ``for`` does not run under the CPU interpreter)
            m, den, acc = _step(q, kv_ptr, kvpos_ptr, qp, b, l0, l1, window, scale, skv_b, skv_l, skp_b, skp_l,
                                m, den, acc, d, BLOCK_L, FP32)
            l0 += BLOCK_L
    if NSPLIT == 1:
        sink = tl.load(sink_ptr + h).to(tl.float32)
        m_fin = tl.maximum(m, sink)
        alpha = tl.exp(m - m_fin)
        den = den * alpha + tl.exp(sink - m_fin)
        out = acc * (alpha / den)[:, None]
        tl.store(out_ptr + b * so_b + h[:, None].to(tl.int64) * so_h + d[None, :], out.to(out_ptr.dtype.element_ty))
    else:
        row = (b * NSPLIT + split) * H + h  # workspace: statistics [B, NSPLIT, H], accumulators [B, NSPLIT, H, D]
        tl.store(m_ptr + row, m)
        tl.store(den_ptr + row, den)
        tl.store(acc_ptr + row[:, None].to(tl.int64) * D + d[None, :], acc)
        if TICKET:
            tl.debug_barrier()  # every thread's partial stores precede the ticket (released by it)
            ticket = ticket_ptr + b * tl.num_programs(1) + hb
            if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == NSPLIT - 1:  # the last of the splits
                tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")  # clean for the next call / replay
                _combine(acc_ptr, m_ptr, den_ptr, sink_ptr, out_ptr, b, h, d, H, so_b, so_h, D, BLOCK_H, NSPLIT)


@triton.jit
def _combine_kernel(acc_ptr, m_ptr, den_ptr, sink_ptr, out_ptr, H, so_b, so_h,
                    D: tl.constexpr, BLOCK_H: tl.constexpr, NSPLIT: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    _combine(acc_ptr, m_ptr, den_ptr, sink_ptr, out_ptr, b, h, tl.arange(0, D), H, so_b, so_h, D, BLOCK_H, NSPLIT)


_TICKETS_MIN = 4096  # tickets (one per sequence x head block) allocated at least


def kernel_takes(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """One query row per sequence, 16-bit activations, heads a multiple of BLOCK_H, a power-of-two head dim."""
    d = q.shape[-1]
    return (q.shape[1] == 1 and q.dtype in (torch.bfloat16, torch.float16) and kv.dtype == q.dtype
            and q.shape[2] % BLOCK_H == 0 and d >= 16 and d & (d - 1) == 0 and d <= 1024
            and q.stride(-1) == 1 and kv.stride(-1) == 1)


_warned_capture = False


def window_attention_triton(q, kv, q_positions, kv_positions, sinks, window: int, scale: float,
                            out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """The kernel on ``kernel_takes`` inputs; ``config`` overrides ``CONFIG`` for this call."""
    global _warned_capture
    b, _, h, d = q.shape
    length = kv.shape[1]
    cfg = resolve_config(b, h, length, d, config)
    nsplit = cfg.splits(length)
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    n_hb = h // cfg.block_h
    ticket = None
    if nsplit > 1:
        ws = torch.empty(b * nsplit * h * (d + 2), dtype=torch.float32, device=q.device)  # one allocation
        acc = ws[: b * nsplit * h * d]
        m, den = ws[b * nsplit * h * d:].view(2, -1)
        if cfg.combine == "ticket":
            ticket = persistent_zeros("window_attention_tickets", q.device, max(b * n_hb, _TICKETS_MIN), torch.int32)
            if ticket is None and not _warned_capture:
                _warned_capture = True
                warnings.warn("dsv4_mtp::window_attention: first call inside CUDA-graph capture, so the split "
                              "combine runs as a second launch in this graph (call the op once before capturing "
                              "to get the one-launch ticket combine).")
    else:
        acc = m = den = out  # unused
    _window_attention_kernel[(b, n_hb, nsplit)](
        q, kv, q_positions, kv_positions, sinks, out, acc, m, den, ticket if ticket is not None else out,
        length, cfg.keys_per_program or length, int(window), float(scale), h,
        q.stride(0), q.stride(2), kv.stride(0), kv.stride(1), q_positions.stride(0),
        kv_positions.stride(0), kv_positions.stride(1), out.stride(0), out.stride(2),
        D=d, BLOCK_H=cfg.block_h, BLOCK_L=cfg.block_l, STEPS=cfg.keys_per_program // cfg.block_l, NSPLIT=nsplit,
        TICKET=ticket is not None, FP32=_INTERPRET,
        num_warps=cfg.num_warps, num_stages=2, **pdl.launch_args(q.device),
    )
    if nsplit > 1 and ticket is None:
        _combine_kernel[(b, n_hb)](acc, m, den, sinks, out, h, out.stride(0), out.stride(2),
                                   D=d, BLOCK_H=cfg.block_h, NSPLIT=nsplit, num_warps=cfg.num_warps,
                                   **pdl.launch_args(q.device))
    return out


@window_attention.register_kernel("cuda")
def _window_attention_cuda(q, kv, q_positions, kv_positions, sinks, window, scale):
    check_window_attention_inputs(q, kv, q_positions, kv_positions, sinks)
    if not kernel_takes(q, kv):
        return sliding_window_attention_reference(q, kv, q_positions, kv_positions, sinks, window, scale)
    with torch.cuda.device(q.device):  # Triton launches on the current device
        return window_attention_triton(q, kv, q_positions, kv_positions, sinks, window, scale)
