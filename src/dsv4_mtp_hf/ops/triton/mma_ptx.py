"""PTX for the small-batch FP4 MoE kernels (``fp4_moe_mma``): decode + scale + ``mma.sync``.

Plain strings, no Triton import, so CPU CI can check them (``tests/test_fp4_moe_op.py``).

One inline-asm call per thread handles one 16-byte "sub-window" (32 FP4 values) of each
of two weight rows ("row a" and "row b") against the activations of up to 8 token
columns.  The warp is laid out so that no data moves between threads:

* lane = 4 * g + q.  Lanes with the same ``g`` own the same two weight rows; ``q``
  selects a quarter of K.  Lane (g, q) reads its own 16 contiguous bytes of both rows
  and the 32 matching activations of token column ``g`` (bf16, 64 bytes).
* ``mma.sync.m16n8k16`` row.col bf16 -> f32.  A is 16 weight rows x 16 K-slots: row g is
  "row a" and row g + 8 is "row b" of lane group g.  K-slots {2q, 2q+1, 2q+8, 2q+9}
  belong to lane q in both A and B, so each lane may put ANY four of its own K values
  there, as long as it puts the matching activations in B.  The MMA then sums the four
  quarters across the lanes.  B column n = token column g.
* Lane (g, q) ends with D[g][2q], D[g][2q+1] (row a, token columns 2q and 2q+1) and
  D[g+8][2q], D[g+8][2q+1] (row b): ``c0..c3``.  Even and odd MMAs go to two
  accumulator sets (A, B) so consecutive MMAs do not wait on each other.

Per 32-bit weight word (8 values, bytes b0..b3), ``DECODE_BODY`` gives the bf16x2 pairs
r0 = (v0, v2), r2 = (v1, v3), r1 = (v4, v6), r3 = (v5, v7) (value i = K element i, low
nibble first).  The MMA on values 0..3 takes A pairs (r0, r2), whose activations are
b0 = (x0, x2), b1 = (x1, x3): two ``prmt`` of the natural activation words (x0, x1),
(x2, x3).

Scales.  NVFP4 (16 values = 2 words a group): raw decode (value x 2**-126) times the
e4m3 scale x 2**63, exact in bf16 (the 2**63 comes back in the fp32 global).  MXFP4 (32
values = the whole sub-window): exact decode (x 2**126) times 2**(e-127) (e = 0 gives the
bf16 subnormal 2**-127 exactly).
"""

from __future__ import annotations

from .decode_ptx import DECODE_BODY

N_OUT = 8  # acc A c0..c3, acc B c0..c3
# operand numbering of one call (pack=4): outputs $0..$7, then inputs in this order
_IN = dict(acc_a=8, acc_b=12, wa=16, wb=20, x=24, sa=40, sb=41)
CONSTRAINTS = ",".join(["=r"] * N_OUT + ["r"] * 34)


def _decode(src: str, out: tuple[str, str, str, str]) -> str:
    """DECODE_BODY on register ``src``; ``out`` receives (r0, r1, r2, r3)."""
    body = DECODE_BODY.replace("$4", src)
    for i, name in enumerate(out):
        body = body.replace(f"r{i},", f"{name},")
    return body


def _scale_pairs(src: str, fmt: str, sub: int, prefix: str) -> str:
    """Broadcast bf16x2 scale pairs for sub-window ``sub`` from four raw scale bytes."""
    if fmt == "nvfp4":
        half = "hl" if sub == 0 else "hh"
        return f"""
mov.b32 {{hl, hh}}, {src};
cvt.rn.f16x2.e4m3x2 st, {half};
mov.b32 {{f0, f1}}, st;
cvt.f32.f16 q0, f0;
cvt.f32.f16 q1, f1;
mul.f32 q0, q0, 0f5F000000;
mul.f32 q1, q1, 0f5F000000;
cvt.rn.bf16x2.f32 {prefix}0, q0, q0;
cvt.rn.bf16x2.f32 {prefix}1, q1, q1;
"""
    # mxfp4: one E8M0 byte for the 32 values of this sub-window
    return f"""
shr.b32 st, {src}, {8 * sub};
and.b32 st, st, 255;
shl.b32 st, st, 7;
max.u32 st, st, 64;
mul.lo.u32 {prefix}0, st, 0x00010001;
mov.b32 {prefix}1, {prefix}0;
"""


def mma_asm(fmt: str, sub: int) -> str:
    """The asm of one call: sub-window ``sub`` (0..3) of the 4 raw scale bytes per row.

    NVFP4 sub-windows use scale bytes (2 sub, 2 sub + 1); MXFP4 uses byte ``sub``."""
    if fmt not in ("nvfp4", "mxfp4"):
        raise ValueError(fmt)
    if fmt == "nvfp4" and sub not in (0, 1):
        raise ValueError("NVFP4 has two sub-windows per 4 scale bytes")
    lines = ["{",
             ".reg .b32 t0, t1, a, st, xa, xb, c126, nz;",
             ".reg .b32 ar0, ar1, ar2, ar3, br0, br1, br2, br3;",
             ".reg .b32 sa0, sa1, sb0, sb1;",
             ".reg .b16 hl, hh, f0, f1;",
             ".reg .f32 q0, q1;",
             "mov.b32 c126, 0x7E807E80;",
             "mov.b32 nz, 0x80008000;",
             _scale_pairs(f"${_IN['sa']}", fmt, sub, "sa"),
             _scale_pairs(f"${_IN['sb']}", fmt, sub, "sb")]
    first = {"a": True, "b": True}
    for j in range(4):
        lines.append(_decode(f"${_IN['wa'] + j}", ("ar0", "ar1", "ar2", "ar3")))
        lines.append(_decode(f"${_IN['wb'] + j}", ("br0", "br1", "br2", "br3")))
        sidx = j // 2 if fmt == "nvfp4" else 0
        for r in ("ar0", "ar1", "ar2", "ar3"):
            if fmt == "mxfp4":
                lines.append(f"fma.rn.bf16x2 {r}, {r}, c126, nz;")
            lines.append(f"fma.rn.bf16x2 {r}, {r}, sa{sidx}, nz;")
        for r in ("br0", "br1", "br2", "br3"):
            if fmt == "mxfp4":
                lines.append(f"fma.rn.bf16x2 {r}, {r}, c126, nz;")
            lines.append(f"fma.rn.bf16x2 {r}, {r}, sb{sidx}, nz;")
        for half, (lo, hi) in enumerate((("0", "2"), ("1", "3"))):
            xw0 = f"${_IN['x'] + 4 * j + 2 * half}"
            xw1 = f"${_IN['x'] + 4 * j + 2 * half + 1}"
            lines.append(f"prmt.b32 xa, {xw0}, {xw1}, 0x5410;")
            lines.append(f"prmt.b32 xb, {xw0}, {xw1}, 0x7632;")
            chain = "a" if half == 0 else "b"
            d0 = 0 if chain == "a" else 4
            dst = f"{{${d0}, ${d0 + 1}, ${d0 + 2}, ${d0 + 3}}}"
            if first[chain]:
                c = _IN["acc_" + chain]
                src = f"{{${c}, ${c + 1}, ${c + 2}, ${c + 3}}}"
                first[chain] = False
            else:
                src = dst
            lines.append(
                f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {dst}, "
                f"{{ar{lo}, br{lo}, ar{hi}, br{hi}}}, {{xa, xb}}, {src};")
    lines.append("}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- fp16 MMA, fp32 block scales
# For ``fp4_moe_hmma`` (its docstring has the lane layout).  One call per lane and 16-byte chunk
# (32 weights) of its two rows: HG decode straight to fp16x2 (K0,K4) (K1,K5) (K2,K6) (K3,K7), two
# ``mma.sync.m16n8k16.f32.f16.f16.f32`` per word of row a + the same word of row b, each scale
# group's MMAs summed from zero into d0..d3, then acc += scale * d in fp32 (c0, c1: row a's scale;
# c2, c3: row b's).  That is exact only because every B column holds ONE lane quarter's K slots
# (the others are zero), so d is this lane's own chunk: the MMA never adds two scale groups.
#
# Operands (pack=1, all 32-bit): outputs $0..$3 = acc; inputs acc $4..$7, row a words $8..$11,
# row b words $12..$15, activations $16..$31 (word w: (K0,K4) (K1,K5) (K2,K6) (K3,K7) at
# $16+4w..$19+4w, i.e. 16 bytes in "pair order"), raw scales of row a $32 and row b $33 (NVFP4:
# the chunk's two e4m3 bytes, low byte = words 0-1; MXFP4: its e8m0 byte).
HMMA_OPS = dict(acc=4, wa=8, wb=12, x=16, sa=32, sb=33)
HMMA_CONSTRAINTS = ",".join(["=r"] * 4 + ["r"] * 30)
_HMMA = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"


def hmma_asm(fmt: str) -> str:
    """The asm of one 16-byte chunk of rows a and b (see above)."""
    from .decode_ptx import HG_DECODE

    if fmt not in ("nvfp4", "mxfp4"):
        raise ValueError(fmt)
    o = HMMA_OPS
    lines = ["{", ".reg .b32 t, zo, ze, z, a04, a15, a26, a37, b04, b15, b26, b37;", ".reg .f32 d0, d1, d2, d3;"]
    if fmt == "nvfp4":  # e4m3 -> f16 -> f32, exact; two groups of 16 weights (2 words each)
        lines += [".reg .b32 sh;", ".reg .b16 h0, h1;", ".reg .f32 fa0, fa1, fb0, fb1;", "mov.b32 z, 0;"]
        for r in ("a", "b"):
            lines += [f"mov.b32 {{h0, h1}}, ${o['s' + r]};", "cvt.rn.f16x2.e4m3x2 sh, h0;", "mov.b32 {h0, h1}, sh;",
                      f"cvt.f32.f16 f{r}0, h0;", f"cvt.f32.f16 f{r}1, h1;"]
        groups = (((0, 1), "fa0", "fb0"), ((2, 3), "fa1", "fb1"))
    else:  # e8m0 e -> fp32 bits e << 23 (e = 0: 2**-127, the fp32 subnormal 0x00400000)
        lines += [".reg .b32 fa0, fb0;", "mov.b32 z, 0;"]
        for r in ("a", "b"):
            lines += [f"shl.b32 f{r}0, ${o['s' + r]}, 23;", f"max.u32 f{r}0, f{r}0, 0x00400000;"]
        groups = (((0, 1, 2, 3), "fa0", "fb0"),)
    d = "{d0, d1, d2, d3}"
    for gi, (words, fa, fb) in enumerate(groups):
        for wi, w in enumerate(words):
            for r in ("a", "b"):
                lines.append(HG_DECODE.format(q=f"${o['w' + r] + w}", t="t", zo="zo", ze="ze", p04=f"{r}04",
                                              p15=f"{r}15", p26=f"{r}26", p37=f"{r}37"))
            x = [f"${o['x'] + 4 * w + i}" for i in range(4)]
            c = "{z, z, z, z}" if wi == 0 else d
            lines.append(f"{_HMMA} {d}, {{a04, b04, a15, b15}}, {{{x[0]}, {x[1]}}}, {c};")
            lines.append(f"{_HMMA} {d}, {{a26, b26, a37, b37}}, {{{x[2]}, {x[3]}}}, {d};")
        src = [f"${o['acc'] + i}" if gi == 0 else f"${i}" for i in range(4)]
        lines += [f"fma.rn.f32 $0, d0, {fa}, {src[0]};", f"fma.rn.f32 $1, d1, {fa}, {src[1]};",
                  f"fma.rn.f32 $2, d2, {fb}, {src[2]};", f"fma.rn.f32 $3, d3, {fb}, {src[3]};"]
    lines.append("}")
    return "\n".join(lines)


def ldg_asm(offsets, width: str = "v4.b32", hint: str = "") -> str:
    """Read-only loads from one 64-bit address operand (the last, after the outputs) at constant
    byte ``offsets``: ``v4.b32`` gives 4 outputs per offset (16 bytes), ``u16`` / ``u8`` one
    (zero-extended).  ``hint``: a cache qualifier such as ``.L1::no_allocate``."""
    n = 4 if width == "v4.b32" else 1
    ptr = f"${n * len(offsets)}"
    lines = []
    for i, off in enumerate(offsets):
        dst = "{" + ", ".join(f"${n * i + j}" for j in range(4)) + "}" if n == 4 else f"${i}"
        lines.append(f"ld.global.nc{hint}.{width} {dst}, [{ptr}+{int(off)}];" if off else
                     f"ld.global.nc{hint}.{width} {dst}, [{ptr}];")
    return "\n".join(lines)
