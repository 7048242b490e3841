"""The fp16 mma.sync path of ``dsv4_mtp::fp4_moe`` (``fp4_moe_hmma``).

CPU: the decode string is HG_WORD's integer part and gives the exact fp16 bits of every code
(``test_fp4_moe_hgemv``'s PTX model, reused); the per-chunk asm (decode, mma.sync, fp32 block
scales) interpreted for a whole warp gives each lane its own chunk's scaled dot products; the
activation prologue's pair order and prescale; the static act prescale; the kernels' plain-Triton
twin under the CPU interpreter (``USE_ASM=False``) through the op's routing.  GPU (``-m gpu``):
against float64 of the same packed weights -- both formats, V4-Flash and V4-Pro, T = 1..16 and
several passes per expert, launch variants, activation scales 1e-3..2e3, NaN-poisoned
workspaces, CUDA-graph replay -- and whether the tensor cores keep fp16 subnormal weights.
"""

from __future__ import annotations

import random
import textwrap

import pytest
import torch

from dsv4_mtp_hf import fp4
from dsv4_mtp_hf.ops.triton import decode_ptx, mma_ptx

from .helpers import SM90_BUILD_PREAMBLE, run_under_triton_interpreter
from .test_fp4_moe_hgemv import _e2m1_f16, _f16_value, _f32_bits, _f32_value, _words, run_ptx
from .test_fp4_moe_op import (LIMIT, SHAPES, _reference_f64_gpu, check_graph_replay, make_experts, make_inputs,
                              rel_err)

PAIR_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # K index at each position of an 8-group in the activation buffers


# ----------------------------------------------------------------------------- CPU: decode
def _instructions(asm: str) -> list[str]:
    return [" ".join(s.split()) for s in asm.split(";") if s.strip() and not s.strip().startswith((".reg", "{", "}"))]


def test_hg_decode_is_hg_word_integer_part():
    """HG_DECODE = HG_WORD without its fma lines (same registers), and decodes every byte value in
    every byte lane, and random words, to the fp16 bits of e2m1 x 2**-14 in pairs (K0,K4) (K1,K5)
    (K2,K6) (K3,K7)."""
    names = dict(q="$1", t="t", zo="zo", ze="ze", p04="p", p15="p", p26="p", p37="p")
    word = [s for s in _instructions(decode_ptx.HG_WORD.format(q="$1", acc="acc", fma37="", x04="x", x15="x", x26="x"))
            if not s.startswith(("fma", "mul"))]
    assert _instructions(decode_ptx.HG_DECODE.format(**names)) == word
    asm = decode_ptx.HG_DECODE.format(q="$1", t="t", zo="zo", ze="ze", p04="p04", p15="p15", p26="p26", p37="p37")
    for w in _words(5):
        r = run_ptx(asm, {"$1": w})
        codes = [(w >> (4 * k)) & 15 for k in range(8)]
        for reg, (ka, kb) in zip(("p04", "p15", "p26", "p37"), ((0, 4), (1, 5), (2, 6), (3, 7))):
            assert r[reg] == _e2m1_f16(codes[ka]) | (_e2m1_f16(codes[kb]) << 16), (hex(w), reg)


# ----------------------------------------------------------------------------- CPU: warp PTX
def _f16_float(bits: int) -> float:
    return float(_f16_value(bits))


def run_warp(asm: str, operands: list[list[int]]) -> list[dict]:
    """Interpret ``mma_ptx.hmma_asm`` for the 32 lanes of a warp: mma.sync (m16n8k16, f16 inputs,
    f32 accumulators: exact sum, one rounding), fma.rn.f32, max.u32 and immediate moves here, every
    other instruction by ``test_fp4_moe_hgemv.run_ptx`` per lane.  Returns the lanes' registers."""
    regs = [{f"${i}": v for i, v in enumerate(ops)} for ops in operands]

    def vec(s):
        return [t.strip() for t in s.strip(" ,").strip("{}").split(",")]

    for stmt in _instructions(asm):
        op, rest = stmt.split(None, 1)
        if op.startswith("mma.sync"):
            assert op.endswith(".f32.f16.f16.f32"), op
            d, a, b, c = (vec(p) for p in rest.split("}") if p.strip(" ,"))
            A = [[0.0] * 16 for _ in range(16)]
            B = [[0.0] * 8 for _ in range(16)]
            C = [[0.0] * 8 for _ in range(16)]
            for lane in range(32):
                g, q = lane >> 2, lane & 3
                r = regs[lane]
                for i, (row, k0) in enumerate(((g, 2 * q), (g + 8, 2 * q), (g, 2 * q + 8), (g + 8, 2 * q + 8))):
                    A[row][k0], A[row][k0 + 1] = _f16_float(r[a[i]]), _f16_float(r[a[i]] >> 16)
                for i, k0 in enumerate((2 * q, 2 * q + 8)):
                    B[k0][g], B[k0 + 1][g] = _f16_float(r[b[i]]), _f16_float(r[b[i]] >> 16)
                for i, (row, col) in enumerate(((g, 2 * q), (g, 2 * q + 1), (g + 8, 2 * q), (g + 8, 2 * q + 1))):
                    C[row][col] = float(_f32_value(r[c[i]]))
            for lane in range(32):
                g, q = lane >> 2, lane & 3
                for i, (row, col) in enumerate(((g, 2 * q), (g, 2 * q + 1), (g + 8, 2 * q), (g + 8, 2 * q + 1))):
                    regs[lane][d[i]] = _f32_bits(C[row][col] + sum(A[row][k] * B[k][col] for k in range(16)))
            continue
        args = [t.strip() for t in rest.split(",")]
        for lane in range(32):
            r = regs[lane]
            if op == "fma.rn.f32":
                x, y, z = (_f32_value(r[t]) for t in args[1:])
                r[args[0]] = _f32_bits(x * y + z)
            elif op == "max.u32":
                r[args[0]] = max(r[args[1]], int(args[2], 0))
            elif op == "mov.b32" and "{" not in rest:
                r[args[0]] = int(args[1], 0)
            else:
                regs[lane] = run_ptx(stmt + ";", r)
    return regs


def _f16_bits_of(v: torch.Tensor) -> list[int]:
    return (v.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF).tolist()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_hmma_ptx_gives_each_lane_its_own_chunk(fmt):
    """One chunk (4 words of row a, 4 of row b per lane) for a whole warp.  B column 2q' + h holds
    token h's activations of quarter q' (lane (2q' + h, q') feeds it, the others feed zeros), so
    lane (g, q) must end with acc + its own chunk's dot products with tokens 0 / 1 (rows a, b),
    each scale group times its own block scale: no other lane's chunk (scale) mixed in."""
    o = mma_ptx.HMMA_OPS
    g = torch.Generator().manual_seed(17 if fmt == "nvfp4" else 18)
    words = torch.randint(0, 2**32, (32, 2, 4), generator=g, dtype=torch.int64)  # lane, row a/b, word
    xs = (torch.randn(4, 2, 32, generator=g, dtype=torch.float64) * 2.0 ** 12).to(torch.float16)  # quarter, token, K
    xs[1, 0, 3] = 2.0 ** -20  # an fp16 subnormal activation
    if fmt == "nvfp4":
        sc = (torch.rand(32, 2, 2, generator=g) * 300 + 0.01).to(torch.float8_e4m3fn).view(torch.uint8)
        sc[0, 0, 1] = 0  # a zero scale and an e4m3 subnormal
        sc[5, 1, 0] = 3
        raw = (sc[..., 0].long() | (sc[..., 1].long() << 8)).tolist()  # one u16 per lane and row
        sval = fp4.decode_scales(sc, "nvfp4").double()  # [lane, row, group]
        group = [k // 16 for k in range(32)]
    else:
        sc = torch.randint(100, 141, (32, 2, 1), generator=g, dtype=torch.uint8)
        sc[3, 0, 0] = 0  # e8m0 0 -> 2**-127 (an fp32 subnormal)
        raw = sc[..., 0].long().tolist()
        sval = torch.tensor([[[2.0 ** (int(e) - 127)] for e in row] for row in sc[..., 0].tolist()], dtype=torch.float64)
        group = [0] * 32
    acc = torch.randn(32, 4, generator=g, dtype=torch.float64)
    ops = []
    for lane in range(32):
        grp, q = lane >> 2, lane & 3
        v = [0] * 34
        for i in range(4):
            v[o["acc"] + i] = _f32_bits(acc[lane, i].item())
            v[o["wa"] + i] = int(words[lane, 0, i])
            v[o["wb"] + i] = int(words[lane, 1, i])
        if q == grp // 2:  # B feeder of column grp: token grp % 2 of quarter q, pair order per word
            bits = _f16_bits_of(xs[q, grp % 2])
            for w in range(4):
                pos = [bits[8 * w + k] for k in PAIR_ORDER]
                for i in range(4):
                    v[o["x"] + 4 * w + i] = pos[2 * i] | (pos[2 * i + 1] << 16)
        v[o["sa"]], v[o["sb"]] = raw[lane][0], raw[lane][1]
        ops.append(v)
    out = run_warp(mma_ptx.hmma_asm(fmt), ops)
    codes = torch.stack([(words >> (4 * k)) & 15 for k in range(8)], dim=-1).reshape(32, 2, 32)
    wv = fp4.decode_e2m1(codes.to(torch.uint8)).double() * 2.0 ** -14  # the decode's units
    xd = xs.double()
    for lane in range(32):
        q = lane & 3
        for i, (row, tok) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
            terms = [wv[lane, row, k].item() * xd[q, tok, k].item() * sval[lane, row, group[k]].item() for k in range(32)]
            want = acc[lane, i].item() + sum(terms)
            got = float(_f32_value(out[lane][f"${i}"]))
            tol = 2e-6 * (sum(abs(t) for t in terms) + abs(acc[lane, i].item()))
            assert abs(got - want) <= tol, (fmt, lane, i, got, want)


def test_ldg_asm_offsets():
    asm = mma_ptx.ldg_asm([0, 64, 4194304], hint=".L1::no_allocate")
    assert asm.splitlines() == ["ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [$12];",
                                "ld.global.nc.L1::no_allocate.v4.b32 {$4, $5, $6, $7}, [$12+64];",
                                "ld.global.nc.L1::no_allocate.v4.b32 {$8, $9, $10, $11}, [$12+4194304];"]
    assert mma_ptx.ldg_asm([0, 8], "u16").splitlines() == ["ld.global.nc.u16 $0, [$2];", "ld.global.nc.u16 $1, [$2+8];"]


# ----------------------------------------------------------------------------- CPU: prescales
PRESCALE_SCRIPT = textwrap.dedent("""
    import torch
    from dsv4_mtp_hf.ops.triton.fp4_moe_hmma import act_prescale, hmma_supports
    for limit in (0.05, 0.5, 1.0, 7.0, 10.0, 100.0, 1e4):
        g = torch.linspace(-50, limit + 50, 40001, dtype=torch.float64)
        sa = act_prescale(limit)
        top = float(torch.nn.functional.silu(g.clamp(max=limit)).abs().max()) * limit  # max |act|
        assert top * 2.0 ** sa <= 65504, (limit, sa)
        assert top * 2.0 ** (sa + 1) > 65504 * 0.99, (limit, sa)  # and the largest such power
    for bad in (float("inf"), float("nan"), 0.0, -1.0, 1e30):
        assert act_prescale(bad) is None
        assert not hmma_supports(4096, 2048, None, bad)  # the op then takes another path
    assert act_prescale(10.0) == 9
    assert hmma_supports(4096, 2048) and hmma_supports(7168, 3072)
    assert not hmma_supports(7168, 3072, dict(gate_up=dict(nsub=4, ksplit=2, num_warps=8)))  # odd K iterations
    # one activation copy per program (share) needs the staged loop and every warp on the same K
    staged = dict(prefetch=0, gate_up=dict(nsub=4), down=dict(nsub=4))
    assert hmma_supports(4096, 2048, dict(staged, share=True), is_nv=False)
    assert not hmma_supports(4096, 2048, dict(staged, share=True, prefetch=1), is_nv=False)
    assert not hmma_supports(4096, 2048, dict(staged, share=True, gate_up=dict(nsub=4, ksplit=2, num_warps=8)),
                             is_nv=False)
    print("OK")
""")


def test_act_prescale_bounds_the_fp16_activation():
    """The static act prescale: |silu(min(g, L)) * clamp(u, -L, L)| * 2**SA fits fp16 with the
    largest such SA; no usable SA (no finite limit, or |act| beyond 2**60 fp16 maxima): no hmma."""
    run_under_triton_interpreter(PRESCALE_SCRIPT, timeout=120)


PROLOGUE_SCRIPT = textwrap.dedent("""
    import torch
    from dsv4_mtp_hf.ops.triton.fp4_moe_hmma import _x_f16_kernel
    g = torch.Generator().manual_seed(3)
    T, P, D, I = 5, 10, 256, 128
    x = torch.randn(T, D, generator=g) * torch.tensor([1.0, 1e-30, 3e4, 1e30, 1.0])[:, None]
    x[4] = 0.0
    x[0, 7] = -2.0 ** 15  # a power of two at the top: s must keep it below 2**15
    x = x.to(torch.bfloat16)
    xh = torch.full((T + 1, D), float("nan"), dtype=torch.float16)
    xs = torch.full((T,), -999, dtype=torch.int32)
    act = torch.full((P + 1, I), float("nan"), dtype=torch.float16)
    _x_f16_kernel[(T + 1,)](x, xh, xs, act, T, P, D, I, DP=256, IP=128)
    order = [0, 4, 1, 5, 2, 6, 3, 7]
    for t in range(T):
        m = float(x[t].float().abs().max())
        s = 120 if m == 0 else min(max(141 - ((torch.tensor(m).view(torch.int32).item() >> 23) & 255), -120), 120)
        assert int(xs[t]) == s, (t, int(xs[t]), s)
        assert m * 2.0 ** s < 2 ** 15 and (m == 0 or m * 2.0 ** s >= 2 ** 14), (t, s)
        want = (x[t].double() * 2.0 ** s).to(torch.float16)  # exact: bf16 values in the fp16 range
        got = xh[t].view(D // 8, 8)[:, torch.tensor(order).argsort()].reshape(D)  # un-permute pair order
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), t
        if 0 < m and t < 4:  # no rounding happened where fp16 is normal
            big = want.abs() >= 2.0 ** -14
            assert torch.equal(got[big].double(), x[t].double()[big] * 2.0 ** s), t
    assert (xh[T] == 0).all() and (act[P] == 0).all() and act[:P].isnan().all()
    print("OK")
""")


def test_activation_prologue_pair_order_and_prescale():
    """``_x_f16_kernel`` under the CPU interpreter: per token s with max|x| * 2**s in [2**14, 2**15)
    (tiny, unit, large and huge rows, an all-zero row), x * 2**s in fp16 in pair order (x0 x4 x1 x5
    x2 x6 x3 x7 per 8), and the zero rows the non-feeding lanes read."""
    run_under_triton_interpreter(PROLOGUE_SCRIPT, timeout=300)


# ----------------------------------------------------------------------------- CPU: interpreter
INTERPRETER_SCRIPT = textwrap.dedent("""
    import random, torch
    from dsv4_mtp_hf import fp4
    from dsv4_mtp_hf.ops import fp4_moe_reference
    from dsv4_mtp_hf.ops.triton import fp4_moe_hmma as hm
    from dsv4_mtp_hf.ops.triton.fp4_moe_triton import fp4_moe_triton
    from dsv4_mtp_hf.ops.triton.moe_pairs import _sum_kernel
    from tests.test_fp4_moe_op import make_experts
    seed = random.SystemRandom().randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    L = 10.0

    def experts(E, D, I, fmt):  # the GPU tests' packed experts, from this run's generator
        return make_experts(E, D, I, fmt, seed=int(torch.randint(0, 2**31, (1,), generator=g)))

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    cases = [  # (fmt, T, E, D, I, config): passes of 2 tokens, K splits, both prefetch schemes
        ("nvfp4", 1, 4, 512, 256, dict(gate_up=dict(nsub=1), down=dict(nsub=1))),
        ("nvfp4", 3, 4, 512, 256, dict(gate_up=dict(nsub=1), down=dict(nsub=1), prefetch=2)),
        ("nvfp4", 9, 4, 512, 256, dict(gate_up=dict(nsub=1), down=dict(nsub=1))),
        ("mxfp4", 1, 4, 512, 256, dict(gate_up=dict(nsub=1), down=dict(nsub=1), prefetch=2)),
        ("mxfp4", 3, 4, 1024, 512, dict(gate_up=dict(num_warps=8, ksplit=2, nsub=1), down=dict(nsub=2))),
        ("mxfp4", 9, 4, 512, 256, dict(gate_up=dict(nsub=1), down=dict(nsub=1))),
        # the staged loop's twin (interleaved chunks, each lane picking from its row's scale window), a K split
        ("nvfp4", 3, 4, 512, 256, dict(gate_up=dict(nsub=2), down=dict(nsub=2), prefetch=0, stages=2)),
        ("nvfp4", 2, 4, 1024, 512, dict(gate_up=dict(num_warps=8, ksplit=2, nsub=2), down=dict(nsub=4), prefetch=0)),
        ("mxfp4", 3, 4, 1024, 512, dict(gate_up=dict(nsub=4), down=dict(nsub=4), prefetch=0)),
        # ... with the B operands copied once per program (share): nsub 4 and the nsub-2 split, 2 and 4 warps
        ("mxfp4", 3, 4, 1024, 512, dict(gate_up=dict(nsub=4), down=dict(nsub=4, num_warps=2), prefetch=0, share=True)),
        ("nvfp4", 5, 4, 512, 256, dict(gate_up=dict(nsub=2), down=dict(nsub=2), prefetch=0, share=True)),
        # ... with the grid walking an expert's row tiles first
        ("nvfp4", 9, 4, 512, 256, dict(gate_up=dict(nsub=2), down=dict(nsub=2), prefetch=0, tiles_first=True)),
    ]
    worst = 0.0
    for fmt, T, E, D, I, cfg in cases:
        k = 2
        W = experts(E, D, I, fmt)
        x = (torch.randn(T, D, generator=g) * 3).to(torch.bfloat16)
        ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices.to(torch.int32)
        rw = (torch.rand(T, k, generator=g) + 0.2).float()
        assert hm.hmma_supports(D, I, cfg, L, fmt == "nvfp4"), cfg
        # the kernels alone, into a NaN-poisoned y: every element written, fp32 sums vs float64
        y = torch.full((T * k, D), float("nan"))
        hm.launch_hmma(x, ids.view(-1), rw.view(-1).contiguous(), *W, None, y, k=k,
                       group_size=fp4.get_format(fmt).group_size, is_nv=fmt == "nvfp4", limit=L, use_asm=False, cfg=cfg)
        assert not y.isnan().any(), (seed, fmt, T)
        want = fp4_moe_reference(x.double(), ids, rw, *W, fmt, L)
        ey = rel(y.view(T, k, D).sum(1), want)
        # through the op's routing (CONFIG keys): the token sums in the down kernel (tickets) and the bf16
        # output; the same bits as the separate sum kernel of y
        out = fp4_moe_triton(x, ids, rw, *W, fmt, L, config=dict(hmma_min_tokens=1, hmma_max_tokens=64, hmma=cfg))
        out2 = fp4_moe_triton(x, ids, rw, *W, fmt, L, config=dict(hmma_min_tokens=1, hmma_max_tokens=64, hmma=cfg,
                                                                  ticket_sum=False))
        assert torch.equal(out, out2), (seed, fmt, T)
        eo = rel(out, want)
        assert ey < 2e-3 and eo < 1e-2, (seed, fmt, T, ey, eo)
        worst = max(worst, eo)
    print("OK", worst)
""")


@pytest.mark.slow
def test_hmma_kernels_under_the_cpu_interpreter():
    """The plain-Triton twin (USE_ASM=False: same loads, lane roles, zero B rows and passes, the
    MMA emulated across the warp) of the prologue, gate/up and down kernels and the op's routing:
    both formats, T = 1 / 3 / 9 (up to 5 passes of 2 tokens), a K split and both prefetch schemes,
    against the float64 reference; ~1 minute."""
    run_under_triton_interpreter(INTERPRETER_SCRIPT, timeout=900)


# ----------------------------------------------------------------------------- CPU: sm_90 build
COMPILE_SCRIPT = SM90_BUILD_PREAMBLE + textwrap.dedent("""
    from dsv4_mtp_hf.ops.triton import fp4_moe_hmma as hm
    cfg = hm.hmma_config()
    for nv in (True, False):
        for kern in ("gate_up", "down"):
            fn, ptrs, consts, nw, w_body, w_pass, nk = sc.hmma_kernel_args(kern, 4096, 2048, nv, cfg)
            k = sc.compile_kernel(fn, ptrs, consts, nw, cfg["maxnreg"])
            ir = k.asm["ttgir"]
            layouts = dict(re.findall(r"^(#blocked\\d*) = #ttg.blocked<(.*)>$", ir, re.M))
            used = {b for line in ir.splitlines() if "elementwise_inline_asm" in line
                    for b in re.findall(r"#blocked\\d*", line)}
            assert used, kern
            for b in used:  # mma.sync needs element i of a [32 NW] tensor in lane i % 32
                assert "sizePerThread = [1], threadsPerWarp = [32], warpsPerCTA = [%d], order = [0]" % nw in layouts[b], (
                    kern, nv, b, layouts[b])
            sass, use = sc.sass_of(k)
            body, _ = sc.loop_counts(sass, "HMMA")
            per_w = len(body) / w_body
            assert use.get("LOCAL", 0) == 0 and use["REG"] <= cfg["maxnreg"], (kern, nv, use)
            assert per_w < 2.0, (kern, nv, per_w)
            assert sum(t.startswith("HMMA.16816.F32") for t in body) == w_body // 8, (kern, nv)  # 2 per 8 x 2 rows
            print(kern, "nvfp4" if nv else "mxfp4", use["REG"], round(per_w, 3), file=sys.stderr)
    # the routed staged loops (fp4_moe_triton.CONFIG["hmma"], NVFP4 with a 96-register cap): no spills, and every
    # asynchronous copy of the K loop 16 bytes wide (4- or 8-byte copies measured 35-40% slower)
    from dsv4_mtp_hf.ops.triton.fp4_moe_triton import CONFIG, route_value
    for nv in (True, False):
        cfg = hm.hmma_config(route_value(CONFIG, "hmma", "nvfp4" if nv else "mxfp4"))
        assert cfg["prefetch"] == 0, cfg
        for kern in ("gate_up", "down"):
            fn, ptrs, consts, nw, w_body, w_pass, nk = sc.hmma_kernel_args(kern, 4096, 2048, nv, cfg)
            k = sc.compile_kernel(fn, ptrs, consts, nw, cfg["maxnreg"])
            sass, use = sc.sass_of(k)
            body, passes = sc.loop_counts(sass, "HMMA")
            body = [re.sub(r"^@!?U?P\\w+\\s+", "", t) for t in body]  # predicates off
            copies = [t for t in body if t.startswith("LDGSTS")]
            # no spills in the K loop; at most a few stack slots reloaded once per pass of 2 tokens (MXFP4's down
            # kernel at 72 registers with the token sums: 16 bytes, 3 reloads per pass)
            spills = sum(t.startswith(("STL", "LDL")) for t in body)
            reloads = sum(re.sub(r"^@!?U?P\\w+\\s+", "", t).startswith("LDL") for t in passes)
            assert use.get("LOCAL", 0) == 0 and use.get("STACK", 0) <= 16 and use["REG"] <= cfg["maxnreg"], (kern, nv, use)
            assert spills == 0 and reloads <= 3, (kern, nv, spills, reloads)
            assert copies and all(t.startswith("LDGSTS.E.BYPASS.128") for t in copies), (kern, nv, sorted(set(copies)))
            assert not any(t.startswith(("SHFL", "STS")) for t in body), (kern, nv)  # no layout conversion in the loop
            # the loop is bound by the integer ALU pipe (ncu, T=16: 73% busy before this check): the B operands'
            # zeroing is an IMAD, not a select per word, and of the decode's four shifts per word only one
            # (K0 wraps round) and the initial rotate are SHF; the other two are IMAD.SHL on the FMA pipe
            words = sum(t.startswith("HMMA.16816.F32") for t in body)  # words decoded: 2 MMAs per word of rows a + b
            sel = sum(t.startswith("SEL") for t in body)
            shf = sum(t.startswith("SHF.") and not t.startswith("SHF.R.S32") for t in body)
            alu = sum(t.startswith(("LOP3", "SHF", "SEL", "IADD3", "ISETP", "VIMNMX", "LEA", "PRMT")) for t in body)
            assert sel <= words // 2 and shf <= 2 * words, (kern, nv, words, sel, shf)
            assert alu <= 10.5 * words, (kern, nv, words, alu)  # measured 9.2 / 10.1 (MXFP4 / NVFP4), 13.3 / 14.2 before
            print("staged", kern, "nvfp4" if nv else "mxfp4", use["REG"], len(copies), words, sel, shf, alu,
                  file=sys.stderr)
    print("OK")
""")


@pytest.mark.slow
def test_hmma_kernels_build_for_sm90():
    """Offline sm_90 build (Triton's ptxas, no GPU) of the default gate/up and down kernels, both
    formats: every inline asm (loads, MMAs) on the one-element-per-thread lane-order layout (the
    fragments assume it), no spills, registers within maxnreg, < 2 SASS instructions per weight in
    the K loop (1.8 NVFP4, 1.7 MXFP4 measured); and of the routed staged loops: no spills, only
    16-byte asynchronous copies and no shuffles or shared stores in the K loop."""
    run_under_triton_interpreter(COMPILE_SCRIPT, timeout=600)


# ----------------------------------------------------------------------------- GPU
ROUTE = dict(hmma_min_tokens=1, hmma_max_tokens=64)
HM_CFGS = {
    "default": dict(),
    "nsub1_pf2": dict(gate_up=dict(nsub=1), down=dict(nsub=1), prefetch=2),
    "w8k2": dict(gate_up=dict(num_warps=8, ksplit=2), down=dict(num_warps=8, ksplit=2)),
    "nsub4": dict(gate_up=dict(nsub=4), down=dict(nsub=4), maxnreg=232, w_hint=".L1::no_allocate"),
    # the staged K loop (prefetch 0): weights, activations and scales through the pipeliner's ring; nsub 4
    # (4 / 8 scale bytes per lane and iteration in both formats)
    "staged": dict(prefetch=0, stages=3, gate_up=dict(nsub=4), down=dict(nsub=4)),
    "staged_s2": dict(prefetch=0, stages=2, gate_up=dict(nsub=4), down=dict(nsub=4)),
    "staged_w8k2": dict(prefetch=0, gate_up=dict(nsub=4, num_warps=8, ksplit=2), down=dict(nsub=4, num_warps=8, ksplit=2)),
    "staged_share": dict(prefetch=0, share=True, gate_up=dict(nsub=4), down=dict(nsub=4)),  # B copied once per program
    "staged_tiles_first": dict(prefetch=0, tiles_first=True, gate_up=dict(nsub=4), down=dict(nsub=4)),  # grid order
    # the MXFP4 default: 2 stages (one buffer) at 72 registers (7 programs per SM)
    "staged_s2_r72": dict(prefetch=0, stages=2, maxnreg=72, gate_up=dict(nsub=4), down=dict(nsub=4)),
}
STAGED_NV_N2 = dict(prefetch=0, gate_up=dict(nsub=2), down=dict(nsub=2))  # NVFP4 only (MXFP4: an 8-byte scale window)


def _fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


def _run_direct(x, ids, rw, W, fmt, over, limit=LIMIT):
    """launch_hmma into a NaN-poisoned y, then the sum kernel into a NaN-poisoned output."""
    from dsv4_mtp_hf.ops.triton import fp4_moe_hmma as hm
    from dsv4_mtp_hf.ops.triton.moe_pairs import _sum_kernel

    T, D = x.shape
    k = ids.shape[1]
    y = torch.full((T * k, D), float("nan"), device=x.device)
    out = torch.full_like(x, float("nan"))
    hm.launch_hmma(x, ids.to(torch.int32).contiguous().view(-1), rw.float().contiguous().view(-1), *W, None, y, k=k,
                   group_size=fp4.get_format(fmt).group_size, is_nv=fmt == "nvfp4", limit=limit, use_asm=True, cfg=over)
    _sum_kernel[(T, (D + 1023) // 1024)](y, out, D, TOPK=k, BLOCK=1024, num_warps=4)
    torch.cuda.synchronize()
    return y, out


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("shape", ["flash", "pro"])
@pytest.mark.parametrize("T", [1, 2, 4, 8, 16])
def test_hmma_matches_f64(fmt, shape, T):
    """Default launch settings; T = 16 on 16 / 8 experts puts ~6-16 tokens on an expert (several
    passes of 2).  Every y element written, the op's routing deterministic and equal to the direct
    launch."""
    from dsv4_mtp_hf.ops.triton.fp4_moe_triton import fp4_moe_triton

    E, D, I = SHAPES[shape]
    k = 6 if shape == "flash" else 8
    seed = _fresh_seed()
    W = make_experts(E, D, I, fmt, device="cuda", seed=seed)
    x, ids, rw = make_inputs(T, E, k, D, device="cuda", seed=seed + 1)
    y, out = _run_direct(x, ids, rw, W, fmt, {})
    assert not y.isnan().any() and not out.isnan().any(), seed
    want = _reference_f64_gpu(x, ids, rw, W, fmt)
    err = rel_err(out, want)
    assert err < 1e-2, (seed, err)
    routed = torch.full_like(x, float("nan"))
    routed.copy_(fp4_moe_triton(x, ids, rw, *W, fmt, LIMIT, config=ROUTE))
    again = fp4_moe_triton(x, ids, rw, *W, fmt, LIMIT, config=ROUTE)
    assert torch.equal(routed, out) and torch.equal(again, out), seed


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("shape", ["flash", "pro"])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("cfg", ["staged", "staged_s2", "staged_w8k2", "staged_share", "staged_tiles_first",
                                 "staged_s2_r72", "staged_nv_n2"])
def test_hmma_staged_matches_f64(fmt, shape, T, cfg):
    """The staged K loop at decode sizes: every y element written, against float64, and the same
    function as the register-prefetch loop (within rounding: both sum in fp32)."""
    E, D, I = SHAPES[shape]
    from dsv4_mtp_hf.ops.triton import fp4_moe_hmma as hm

    over = STAGED_NV_N2 if cfg == "staged_nv_n2" else HM_CFGS[cfg]
    if cfg == "staged_nv_n2" and fmt == "mxfp4":  # an 8-byte scale window per row and iteration: not taken
        assert not hm.hmma_supports(D, I, over, LIMIT, is_nv=False)
        with pytest.raises(ValueError, match="not supported"):
            _run_direct(*make_inputs(1, E, 6, D, device="cuda", seed=1), make_experts(E, D, I, fmt, device="cuda", seed=2), fmt, over)
        return
    k = 6 if shape == "flash" else 8
    seed = _fresh_seed()
    W = make_experts(E, D, I, fmt, device="cuda", seed=seed)
    x, ids, rw = make_inputs(T, E, k, D, device="cuda", seed=seed + 1)
    y, out = _run_direct(x, ids, rw, W, fmt, over)
    assert not y.isnan().any() and not out.isnan().any(), seed
    want = _reference_f64_gpu(x, ids, rw, W, fmt)
    assert rel_err(out, want) < 1e-2, seed
    _, base = _run_direct(x, ids, rw, W, fmt, {})
    assert rel_err(out, base) < 1e-3, seed


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("cfg", sorted(HM_CFGS))
def test_hmma_variants_many_tokens_on_one_expert(fmt, cfg):
    """20 tokens on expert 3 (10 passes) beside one token per other expert, each launch variant."""
    E, D, I = SHAPES["flash"]
    seed = _fresh_seed()
    W = make_experts(E, D, I, fmt, device="cuda", seed=seed)
    x, ids, rw = make_inputs(20, E, 2, D, device="cuda", seed=seed + 1)
    ids[:, 1] = 3
    ids[:, 0] = torch.where(ids[:, 0] == 3, 4, ids[:, 0])
    y, out = _run_direct(x, ids, rw, W, fmt, HM_CFGS[cfg])
    assert not y.isnan().any() and not out.isnan().any(), seed
    assert rel_err(out, _reference_f64_gpu(x, ids, rw, W, fmt)) < 1e-2, seed


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 100.0, 2000.0])
def test_hmma_activation_scales(fmt, scale):
    """Exact products and fp32 sums: the error must not grow with the activation scale (the fp16x2
    GEMV reaches 1.8e-2 at 2000x).  Compared with the default tl.dot path on the same inputs: the
    same ~2.3e-3 (the bf16 output), at every scale.  A unit row gets an outlier of 3e4."""
    from dsv4_mtp_hf.ops.triton.fp4_moe_triton import fp4_moe_triton

    E, D, I = SHAPES["flash"]
    seed = _fresh_seed()
    W = make_experts(E, D, I, fmt, device="cuda", seed=seed)
    x, ids, rw = make_inputs(20, E, 2, D, device="cuda", seed=seed + 1)
    x = (x.float() * scale).to(torch.bfloat16)
    if scale == 1.0:
        x[0, 5] = -3e4
    _, out = _run_direct(x, ids, rw, W, fmt, {})
    want = _reference_f64_gpu(x, ids, rw, W, fmt)
    err = rel_err(out, want)
    err_dot = rel_err(fp4_moe_triton(x, ids, rw, *W, fmt, LIMIT, config=dict(mma_max_tokens=0, gemv_max_tokens=0, hmma_max_tokens=0)), want)
    assert not out.isnan().any() and err < 1e-2, (seed, scale, err, err_dot)
    assert err < 1.5 * err_dot + 1e-3, (seed, scale, err, err_dot)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_hmma_fp16_subnormal_weights(fmt):
    """Only +-0.5 codes: the decode gives fp16 subnormals (0.5 x 2**-14) for every weight.  If the
    tensor cores flushed subnormal fp16 inputs to zero the output would be ~0 (error ~1)."""
    E, D, I = SHAPES["flash"]
    seed = _fresh_seed()
    w13, s13, g13, w2, s2, g2 = make_experts(E, D, I, fmt, device="cuda", seed=seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 2)

    def halves(t):  # each nibble 0x1 (+0.5) or 0x9 (-0.5)
        r = torch.randint(0, 4, t.shape, device="cuda", generator=gen, dtype=torch.uint8)
        return (0x11 | ((r & 1) << 3) | ((r & 2) << 6)).to(torch.uint8)

    W = (halves(w13), s13, g13 * 4, halves(w2), s2, g2 * 4)  # x4: gate values of the usual size
    x, ids, rw = make_inputs(4, E, 6, D, device="cuda", seed=seed + 1)
    _, out = _run_direct(x, ids, rw, W, fmt, {})
    want = _reference_f64_gpu(x, ids, rw, W, fmt)
    err = rel_err(out, want)
    assert err < 1e-2, (
        f"fp16 subnormal weights (e2m1 +-0.5 decode to 0.5 x 2**-14) came out wrong (rel. err {err:.3g}, seed {seed}): "
        "the tensor cores seem to flush fp16 subnormal MMA inputs, so fp4_moe_hmma's decode must not be used")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_hmma_cuda_graph_replay(fmt):
    from dsv4_mtp_hf.ops.triton.fp4_moe_triton import fp4_moe_triton

    check_graph_replay(lambda *args: fp4_moe_triton(*args, config=ROUTE), fmt, _fresh_seed())


@pytest.mark.gpu
def test_hmma_routing_needs_a_static_act_prescale():
    """A limit with no usable static act prescale (|act| up to 1e60): the routed op takes the
    default path."""
    from dsv4_mtp_hf.ops.triton.fp4_moe_triton import fp4_moe_triton

    E, D, I = SHAPES["flash"]
    W = make_experts(E, D, I, "nvfp4", device="cuda", seed=3)
    x, ids, rw = make_inputs(2, E, 6, D, device="cuda", seed=4)
    got = fp4_moe_triton(x, ids, rw, *W, "nvfp4", 1e30, config=ROUTE)
    ref = fp4_moe_triton(x, ids, rw, *W, "nvfp4", 1e30)
    assert torch.equal(got, ref)


def test_module_constants():
    """The hmma asm strings keep the documented operand layout (34 operands, 8 MMAs per chunk)."""
    for fmt in ("nvfp4", "mxfp4"):
        asm = mma_ptx.hmma_asm(fmt)
        assert asm.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") == 8
        assert asm.count("fma.rn.f32") == (8 if fmt == "nvfp4" else 4)
        assert "$33" in asm and "$34" not in asm
    assert mma_ptx.HMMA_CONSTRAINTS.count("=r") == 4 and mma_ptx.HMMA_CONSTRAINTS.count(",") == 33
