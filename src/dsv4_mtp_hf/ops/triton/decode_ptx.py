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
