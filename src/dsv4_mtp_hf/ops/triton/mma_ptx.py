"""PTX of the fp16 ``mma.sync`` chunk of ``fp4_moe_hmma`` (its docstring has the lane layout).

One call per lane and 16-byte chunk (32 weights) of its two rows a and b: HG decode straight to
fp16x2 (K0,K4) (K1,K5) (K2,K6) (K3,K7), two ``mma.sync.m16n8k16.f32.f16.f16.f32`` per word of row a
and the same word of row b, each scale group's MMAs summed from zero into d0..d3, then
acc += scale * d in fp32 (c0, c1: row a's scale; c2, c3: row b's).  That is exact only because every
B column holds ONE lane quarter's K slots (the others are zero), so d is this lane's own chunk: the
MMA never adds two scale groups.

Operands (pack=1, all 32-bit): outputs $0..$3 = acc; inputs acc $4..$7, row a words $8..$11, row b
words $12..$15, activations $16..$31 (word w: (K0,K4) (K1,K5) (K2,K6) (K3,K7) at $16+4w..$19+4w,
16 bytes in "pair order"), raw scales of row a $32 and row b $33 (NVFP4: the chunk's two e4m3
bytes, low byte = words 0-1; MXFP4: its e8m0 byte).
"""

from __future__ import annotations

from .decode_ptx import HG_DECODE

HMMA_OPS = dict(acc=4, wa=8, wb=12, x=16, sa=32, sb=33)
HMMA_CONSTRAINTS = ",".join(["=r"] * 4 + ["r"] * 30)
_HMMA = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"


def hmma_asm(fmt: str) -> str:
    """The asm of one 16-byte chunk of rows a and b (see above)."""
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
