"""L2 prefetch of bytes that a later kernel will read (sm_90 ``cp.async.bulk.prefetch.L2``).

Why: at T=1 the routed MoE's down kernel starts cold. Its ~25 MB of weights (V4-Flash, 6 experts)
do not depend on the gate/up kernel's result, only on the routing. So gate/up can ask L2 to fetch
them while its own loads are still in flight, and down then reads them from L2 instead of
paying HBM latency through its short K loop (4 steps per program). A bulk prefetch is a hint: it
holds no register or shared memory, nothing waits for it, and results cannot change.

Only for byte counts that fit in L2 beside the gate/up stream (the caller decides; the H200 has
50 MB of L2).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def l2_prefetch(ptr, NBYTES: tl.constexpr, NT: tl.constexpr):
    """Prefetch ``NBYTES`` contiguous bytes at the uint8 pointer ``ptr`` (16-byte aligned, ``NBYTES``
    a multiple of 16) into L2: ``NT`` threads (the program's, one chunk each) issue one bulk
    prefetch of up to ``CHUNK`` bytes."""
    CHUNK: tl.constexpr = (NBYTES + 16 * NT - 1) // (16 * NT) * 16
    off = tl.arange(0, NT).to(tl.int64) * CHUNK
    size = tl.minimum(NBYTES - off, CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [(ptr + off).to(tl.int64, bitcast=True), size], dtype=tl.int32, is_pure=False, pack=1)
