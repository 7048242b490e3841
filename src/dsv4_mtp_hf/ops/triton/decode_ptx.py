"""PTX for the in-register FP4 (e2m1) decode of the FP4 MoE kernels (plain strings, no Triton import).

bf16 (``DECODE_*``, the tl.dot and stream kernels): e2m1 code c (bit 3 sign, bits 0-2 = e1 e0 m) ->
bf16 bits (c&8)<<12 | (c&7)<<6 is the exact value times 2**-126 (e == 0 lands on the bf16 subnormals
0 and 2**-127).  With the nibble alone in a 16-bit lane, one multiply by 0x1040 puts c at bits 6-9 and
12-15 (disjoint, no carries) and one mask keeps bits 6-8 and 15: and / mul / and per two values (the
high nibble, at bits 4-7, uses 0x0104).  One call takes four packed bytes ($4) and returns the four
low-nibble values ($0 = bytes 0,1; $1 = bytes 2,3) and the four high-nibble values ($2, $3) as
bf16x2.  ``DECODE_ASM`` multiplies by 2**126 (a bf16x2 FMA adding -0, so -0 stays -0) to get the
exact value (MXFP4); ``DECODE_ASM_RAW`` leaves the 2**-126 to the block scale and fp32 global
(2**63 each, exact for every e4m3 scale: NVFP4).
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
# 0-3, $4-$7: high nibbles), for the streamed FMA GEMV (``fp4_moe_stream``).  Same decode as
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

# fp16 (``HG_DECODE``, the fp16 mma.sync kernels of ``fp4_moe_hmma``): sign at bit 15, e1 e0 m at
# bits 11..9, so the fp16 value is the e2m1 value times 2**-14 (codes 0 and +-0.5 are fp16 subnormals,
# exact); mask 0x8E00 per 16-bit lane keeps exactly those bits.  Word {q} holds codes K0..K7 (byte j:
# K2j low nibble, K2j+1 high).  With t = rotr(q, 3), lop3 select(C, q, t) puts in every byte a code's
# sign at bit 7 (from q) and its magnitude at bits 3..1 (from t): C = 0x80808080 for the high nibbles
# (zo), 0x08080808 for the low ones (ze).  Then one shift or rotation and one mask per fp16x2 pair:
#   zo & M = (K3, K7)   (zo << 8) & M = (K1, K5)   (ze << 4) & M = (K2, K6)   rotl(ze, 12) & M = (K0, K4)
# 10 integer instructions per 8 weights.  Only K0's magnitude wraps around the word, so the other two
# are plain shifts (ptxas issues them as IMAD.SHL on the FMA pipe; the hmma K loop is bound by the
# integer ALU pipe).  {t}, {zo}, {ze} are scratch registers.
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
