"""PTX for the in-register FP4 (e2m1) decode used by the Triton kernels (``fp4_moe_triton``).

Plain strings, no Triton import, so CPU CI can check the constants bit for bit
(``tests/test_fp4_moe_op.py`` interprets ``DECODE_BODY`` for every byte value).

e2m1 code c (bit 3 sign, bits 0-2 = e1 e0 m) -> bf16 bits (c&8)<<12 | (c&7)<<6 is the exact
value times 2**-126 (e == 0 lands on the bf16 subnormals 0 and 2**-127).  With the nibble
alone in a 16-bit lane (bits 0-3), one multiply by 0x1040 = (1<<6) + (1<<12) puts c at bits
6-9 and again at bits 12-15 (disjoint, so no carries), and one mask keeps bits 6-8 and 15:
and / mul / and per two values (the high nibble, at bits 4-7, uses 0x0104).  This replaced a
shift/and/or sequence (and, shl, and, shl, or per two values): 12% fewer instructions in
the gate/up loop (SASS, sm_90).

One call takes four packed bytes ($4) and returns the four low-nibble values ($0 = bytes
0,1; $1 = bytes 2,3) and the four high-nibble values ($2, $3) as bf16x2.  ``DECODE_ASM``
multiplies by 2**126 (one bf16x2 FMA by 0x7E80, adding -0 so -0 codes stay -0) to get the
exact value; ``DECODE_ASM_RAW`` leaves the 2**-126 for the block scale and the fp32 global
to take back (2**63 each, "fold").
"""

DECODE_BODY = """
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
and.b32 a, t0, 0x000F000F;
mul.lo.u32 a, a, 0x1040;
and.b32 r0, a, 0x81C081C0;
and.b32 a, t1, 0x000F000F;
mul.lo.u32 a, a, 0x1040;
and.b32 r1, a, 0x81C081C0;
and.b32 a, t0, 0x00F000F0;
mul.lo.u32 a, a, 0x0104;
and.b32 r2, a, 0x81C081C0;
and.b32 a, t1, 0x00F000F0;
mul.lo.u32 a, a, 0x0104;
and.b32 r3, a, 0x81C081C0;
"""

DECODE_ASM = """
{
.reg .b32 t0, t1, a, r0, r1, r2, r3, c126, nz;
mov.b32 c126, 0x7E807E80;
mov.b32 nz, 0x80008000;
""" + DECODE_BODY + """
fma.rn.bf16x2 $0, r0, c126, nz;
fma.rn.bf16x2 $1, r1, c126, nz;
fma.rn.bf16x2 $2, r2, c126, nz;
fma.rn.bf16x2 $3, r3, c126, nz;
}
"""

DECODE_ASM_RAW = """
{
.reg .b32 t0, t1, a, r0, r1, r2, r3;
""" + DECODE_BODY + """
mov.b32 $0, r0;
mov.b32 $1, r1;
mov.b32 $2, r2;
mov.b32 $3, r3;
}
"""

# One int32 word of four packed bytes -> eight fp32 values ($0-$3: low nibbles of bytes
# 0-3, $4-$7: high nibbles), for the FMA GEMV kernels (``fp4_moe_gemv``).  Same decode as
# above, then bf16 -> fp32 by position (``<< 16`` for the low half, ``& 0xFFFF0000`` for the
# high half).  ``DECODE8_F32_RAW`` leaves the 2**-126 for the scales ("fold").
_TO_F32 = """
shl.b32 $0, r0, 16;
and.b32 $1, r0, 0xFFFF0000;
shl.b32 $2, r1, 16;
and.b32 $3, r1, 0xFFFF0000;
shl.b32 $4, r2, 16;
and.b32 $5, r2, 0xFFFF0000;
shl.b32 $6, r3, 16;
and.b32 $7, r3, 0xFFFF0000;
}
"""

DECODE8_F32_RAW = """
{
.reg .b32 t0, t1, a, r0, r1, r2, r3;
""" + DECODE_BODY.replace("$4", "$8") + _TO_F32

DECODE8_F32 = """
{
.reg .b32 t0, t1, a, r0, r1, r2, r3, c126, nz;
mov.b32 c126, 0x7E807E80;
mov.b32 nz, 0x80008000;
""" + DECODE_BODY.replace("$4", "$8") + """
fma.rn.bf16x2 r0, r0, c126, nz;
fma.rn.bf16x2 r1, r1, c126, nz;
fma.rn.bf16x2 r2, r2, c126, nz;
fma.rn.bf16x2 r3, r3, c126, nz;
""" + _TO_F32

# ----------------------------------------------------------------------------- fp16x2 GEMV
# For the HFMA2 GEMV kernels (``fp4_moe_hgemv``).  fp16 bits of an e2m1 code: sign at bit 15,
# e1 e0 m at bits 11..9 (exponent low bits + top mantissa bit), so the fp16 value is the
# e2m1 value times 2**-14 (codes 0 and +-0.5 land on the fp16 subnormals, exactly).  Per
# 16-bit lane, mask 0x8E00 keeps exactly those bits.
#
# One int32 word q holds codes K0..K7 (byte j: K2j in the low nibble, K2j+1 in the high).
# With t = rotr(q, 3), select(C, q, t) = (q & C) | (t & ~C) puts, in every byte, a code's sign
# at bit 7 (from q) and its magnitude at bits 3..1 (from t): C = 0x80808080 does that for the
# high nibbles (Zo), C = 0x08080808 (then << 4 / rotl 12) for the low nibbles (Ze; the rotation, not a
# shift, brings K0's magnitude, which t wrapped to bits 31..29, into byte 0).  Each byte is
# then an fp16 high byte; a shift by 0/8 (Zo) or 4, a rotation by 12 (Ze) moves two of them into the
# high bytes of the two lanes and the mask clears the rest.  Lanes (low, high):
#   Zo & M = (K3, K7)   (Zo << 8) & M = (K1, K5)   (Ze << 4) & M = (K2, K6)   rotl(Ze, 12) & M = (K0, K4)
# i.e. 1 rotate + 2 lop3 per word, and 1 and (+1 shift or rotate) per pair: 10 integer instructions and
# 4 fma.rn.f16x2 per 8 weights (Marlin's chained decode, shift q by 4 between pairs, is 15).  Only K0's
# magnitude wraps around the word (Ze bits 31..29); for K1 / K2 the mask drops what a rotation would bring
# round, so those two are plain shifts, which ptxas issues as IMAD.SHL on the FMA pipe instead of SHF on the
# integer ALU pipe (the fp16 MMA loops of ``fp4_moe_hmma`` are bound by that pipe: ncu at T=16, 73% busy).
HG_MASK = 0x8E008E00
HG_WORD = """
shf.r.wrap.b32 t, {q}, {q}, 3;
lop3.b32 zo, {q}, t, 0x80808080, 0xE4;
lop3.b32 ze, {q}, t, 0x08080808, 0xE4;
and.b32 p, zo, 0x8E008E00;
{fma37}
shl.b32 p, zo, 8;
and.b32 p, p, 0x8E008E00;
fma.rn.f16x2 {acc}, p, {x15}, {acc};
shl.b32 p, ze, 4;
and.b32 p, p, 0x8E008E00;
fma.rn.f16x2 {acc}, p, {x26}, {acc};
shf.l.wrap.b32 p, ze, ze, 12;
and.b32 p, p, 0x8E008E00;
fma.rn.f16x2 {acc}, p, {x04}, {acc};
"""


def _hg_asm(words: int, scale16: bool = False) -> str:
    """``words`` int32 words -> fp32 dot with their activations.  Operands: $0 (f32 out);
    $1..$W the words; then per word i the four fp16x2 activation pairs (K0,K4) (K1,K5)
    (K2,K6) (K3,K7) at $(1+W+4i) .. $(4+W+4i); with ``scale16`` last the raw NVFP4 scales.

    Plain (one scale group: 2 words NVFP4, 4 MXFP4): the products accumulate in fp16x2 (one
    lane per half of the word) over the group only; the two lanes are converted to fp32 and
    added, the block scale is the caller's (fp32).
    ``scale16`` (NVFP4, 4 words = two groups): each group accumulates in its own fp16x2; the
    two e4m3 scales ($(1+5W), low byte = first group) convert exactly to fp16, scale their
    group in fp16 (one mul + one fma for both), then the two lanes go to fp32 and add."""
    body = []
    for i in range(words):
        x = [f"${1 + words + 4 * i + j}" for j in range(4)]
        acc = "accb" if scale16 and i >= 2 else "acc"
        first = i == 0 or (scale16 and i == 2)  # the group's first product starts its sum
        fma37 = f"mul.rn.f16x2 {acc}, p, {x[3]};" if first else f"fma.rn.f16x2 {acc}, p, {x[3]}, {acc};"
        body.append(HG_WORD.format(q=f"${1 + i}", acc=acc, fma37=fma37, x04=x[0], x15=x[1], x26=x[2]))
    tail = ""
    if scale16:
        tail = (f"mov.b32 {{h0, h1}}, ${1 + 5 * words};\ncvt.rn.f16x2.e4m3x2 s, h0;\nmov.b32 {{h0, h1}}, s;\n"
                "mov.b32 sa, {h0, h0};\nmov.b32 sb, {h1, h1};\nmul.rn.f16x2 acc, acc, sa;\nfma.rn.f16x2 acc, accb, sb, acc;\n")
    return ("{\n.reg .b32 t, zo, ze, p, acc, accb, s, sa, sb;\n.reg .b16 h0, h1;\n.reg .f32 f0, f1;\n" + "".join(body)
            + tail + "mov.b32 {h0, h1}, acc;\ncvt.f32.f16 f0, h0;\ncvt.f32.f16 f1, h1;\nadd.f32 $0, f0, f1;\n}\n")


HG_GROUP2 = _hg_asm(2)  # NVFP4: one 16-weight scale group
HG_GROUP4 = _hg_asm(4)  # MXFP4: one 32-weight scale group
HG_CHUNK_NV16 = _hg_asm(4, scale16=True)  # NVFP4, two groups, block scales applied in fp16

# Activations: four int32 words of bf16 pairs (x0..x3 = (K0,K1) (K2,K3) (K4,K5) (K6,K7)) ->
# the four fp16x2 pairs the decode above multiplies: $0 = (K0,K4), $1 = (K1,K5), $2 = (K2,K6),
# $3 = (K3,K7), each times 2**s.  $5 = s * 0x00800080 adds s to both bf16 exponents (exact for
# 0 <= s and no exponent overflow; zeros and bf16 subnormals become values below 2**(s-127),
# which round to fp16 zero for s <= 100), then bf16 -> fp32 by position and a rounding
# conversion to fp16 (exact: bf16 has 8 significant bits, fp16 11, in the normal range).
# HG_XCVT loads the four words itself from the address $4 (16 bytes, read-only path).
HG_XCVT_BODY = """
add.u32 a, x0, $5;
add.u32 b, x2, $5;
shl.b32 la, a, 16;
and.b32 ha, a, 0xFFFF0000;
shl.b32 lb, b, 16;
and.b32 hb, b, 0xFFFF0000;
cvt.rn.f16x2.f32 $0, lb, la;
cvt.rn.f16x2.f32 $1, hb, ha;
add.u32 a, x1, $5;
add.u32 b, x3, $5;
shl.b32 la, a, 16;
and.b32 ha, a, 0xFFFF0000;
shl.b32 lb, b, 16;
and.b32 hb, b, 0xFFFF0000;
cvt.rn.f16x2.f32 $2, lb, la;
cvt.rn.f16x2.f32 $3, hb, ha;
"""
HG_XCVT = ("{\n.reg .b32 x0, x1, x2, x3, a, b, la, ha, lb, hb;\nld.global.nc.v4.b32 {x0, x1, x2, x3}, [$4];\n"
           + HG_XCVT_BODY + "}\n")

# The integer part of HG_WORD alone (the fp16 MMA kernels of ``fp4_moe_hmma``): word {q} -> the
# fp16x2 pairs {p04} = (K0,K4), {p15} = (K1,K5), {p26} = (K2,K6), {p37} = (K3,K7), each weight the
# e2m1 value times 2**-14 exactly; {t}, {zo}, {ze} are scratch.  Same 10 instructions as HG_WORD
# (tests/test_fp4_moe_hmma.py checks that, and the bits of every byte value).
HG_DECODE = """
shf.r.wrap.b32 {t}, {q}, {q}, 3;
lop3.b32 {zo}, {q}, {t}, 0x80808080, 0xE4;
lop3.b32 {ze}, {q}, {t}, 0x08080808, 0xE4;
and.b32 {p37}, {zo}, 0x8E008E00;
shl.b32 {p15}, {zo}, 8;
and.b32 {p15}, {p15}, 0x8E008E00;
shl.b32 {p26}, {ze}, 4;
and.b32 {p26}, {p26}, 0x8E008E00;
shf.l.wrap.b32 {p04}, {ze}, {ze}, 12;
and.b32 {p04}, {p04}, 0x8E008E00;
"""
