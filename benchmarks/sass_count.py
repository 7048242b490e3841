#!/usr/bin/env python3
"""SASS instruction counts of the FP4 MoE GEMV kernels, compiled offline for sm_90 (no GPU needed):
the FMA GEMV (``fp4_moe_gemv``) against the fp16x2 HFMA2 GEMV (``fp4_moe_hgemv``).

    python benchmarks/sass_count.py [--hidden 4096 --inter 2048 --topk 6 --t 1] [--hist]

Needs Triton (its bundled ptxas / cuobjdump).  For each kernel and launch configuration it
prints registers, local memory (spills), and the static instruction count of the K loop
per weight a thread handles per K step, and of the whole pass over one token (K loop x steps
+ the rest of the pass: activation prescale, cross-lane reduction, epilogue) per weight of
the pass.  Static counts: the loop bodies are straight-line code, so they equal what one
thread issues per iteration.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_sass(fn, ptrs: dict, consts: dict, num_warps: int):
    sig = {n: ptrs.get(n) or ("i32" if n == "P" else "constexpr") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs}  # as the JIT specialises
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=1))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as fh:
            fh.write(k.asm["cubin"])
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
    usage = dict(re.findall(r"(REG|LOCAL|STACK):(\d+)", res))
    return sass, {k: int(v) for k, v in usage.items()}


def loop_counts(sass: str):
    """(innermost loop body, its enclosing loop body) as lists of instructions."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    loops = []
    for addr, txt in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", txt)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    inner = min((lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)),
                key=lambda lp: lp[1] - lp[0])
    outer = min((lp for lp in loops if lp != inner and lp[0] <= inner[0] and inner[1] <= lp[1]),
                key=lambda lp: lp[1] - lp[0], default=None)

    def body(lp):
        return [t for a, t in ins if lp[0] <= a <= lp[1]] if lp else []

    return body(inner), body(outer)


def hist(body):
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in body)


def report(name, fn, ptrs, consts, num_warps, w_step, w_pass, nk, show_hist):
    try:
        sass, use = compile_sass(fn, ptrs, consts, num_warps)
    except Exception as err:  # noqa: BLE001
        print(f"{name:34s} FAILED: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
        return
    inner, outer = loop_counts(sass)
    per_pass = (len(outer) - len(inner)) + nk * len(inner) if outer else None
    print(f"{name:34s} regs {use.get('REG', 0):3d}  local(spill) {use.get('LOCAL', 0):4d} B  "
          f"K loop {len(inner):5d} instr / {w_step:4d} w = {len(inner) / w_step:5.2f}/w   "
          f"pass {'%.2f' % (per_pass / w_pass) if per_pass else '-':>5s}/w")
    if show_hist:
        print("    K loop:", ", ".join(f"{k} {v}" for k, v in hist(inner).most_common()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--t", type=int, default=1, help="tokens (sets the pass count P = T * topk)")
    ap.add_argument("--hist", action="store_true", help="also print the K loop's instruction histogram")
    args = ap.parse_args()
    from dsv4_mtp_hf.ops.triton import fp4_moe_gemv as gv
    from dsv4_mtp_hf.ops.triton import fp4_moe_hgemv as hg

    D, I, p = args.hidden, args.inter, args.t * args.topk
    pb = max(16, triton.next_power_of_2(p))
    common = dict(I=I, D=D, PB=pb)
    print(f"sm_90, D={D} I={I} top-{args.topk} T={args.t}; per weight = per-thread instructions / weights per thread")

    gu_ptrs = {"xw_ptr": "*i32", "ids_ptr": "*i32", "rw_ptr": "*fp32", "w_ptr": "*i32", "s_ptr": "*u8",
               "g_ptr": "*fp32", "act_ptr": "*bf16"}
    dn_ptrs = {"aw_ptr": "*i32", "ids_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*u8", "g_ptr": "*fp32", "y_ptr": "*fp32"}
    for fmt, G in (("nvfp4", 16), ("mxfp4", 32)):
        nv = fmt == "nvfp4"
        print(f"--- {fmt}")
        # FMA GEMV (fold as the op runs it: NVFP4 folds, MXFP4 does not by default)
        for label, bn_gu, bn_dn in (("gv16 (default)", 16, 32), ("gv32", 32, 32)):
            cg = dict(gv.GEMV_CONFIG["gate_up"], BLOCK_N=bn_gu)
            cd = dict(gv.GEMV_CONFIG["down"], BLOCK_N=bn_dn)
            for kern, c, ptrs, K, two in (("gate/up", cg, gu_ptrs, D, 2), ("down", cd, dn_ptrs, I, 1)):
                fn = gv._gate_up_gemv_kernel if kern == "gate/up" else gv._down_gemv_kernel
                consts = dict(common, G=G, IS_NV=nv, NPASS=p, M=1, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], PF=1,
                              USE_ASM=True, FOLD=nv)
                if kern == "gate/up":
                    consts.update(TOPK=args.topk, LIMIT=10.0)
                nt = 32 * c["num_warps"]
                report(f"FMA  {kern:7s} {label} N{c['BLOCK_N']}", fn, ptrs, consts, c["num_warps"],
                       two * c["BLOCK_N"] * c["BLOCK_K"] // nt, two * c["BLOCK_N"] * K // nt, K // c["BLOCK_K"],
                       args.hist)
        # fp16x2 GEMV
        hptrs_gu = dict(gu_ptrs, s_ptr="*i16" if nv else "*u8")
        hptrs_dn = dict(dn_ptrs, s_ptr="*i16" if nv else "*u8")
        variants = [("default", {}), ("pf", dict(pf=True))]
        if nv:
            variants += [("scale16", dict(scale16=True))]
        variants += [("hg16", dict(gate_up=dict(BLOCK_N=16, BLOCK_K=1024, num_warps=4),
                                   down=dict(BLOCK_N=32, BLOCK_K=512, num_warps=4))),
                     ("down 2 warps", dict(gate_up=dict(BLOCK_N=64, BLOCK_K=512, num_warps=4),
                                           down=dict(BLOCK_N=64, BLOCK_K=512, num_warps=2)))]
        for label, over in variants:
            cfg = {**hg.HGEMV_CONFIG, **over}
            scale16 = bool(cfg["scale16"]) and nv
            xtop = cfg["xtop"] or (14 if scale16 else 15)
            for kern in ("gate/up", "down"):
                c = cfg["gate_up"] if kern == "gate/up" else cfg["down"]
                K, two = (D, 2) if kern == "gate/up" else (I, 1)
                consts = dict(common, IS_NV=nv, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
                              XW2=triton.next_power_of_2(K // 2), XTOP=xtop, SCALE16=scale16, PF=bool(cfg["pf"]),
                              USE_ASM=True, NPASS=0)
                if kern == "gate/up":
                    consts.update(TOPK=args.topk, LIMIT=10.0)
                fn = hg._gate_up_hgemv_kernel if kern == "gate/up" else hg._down_hgemv_kernel
                nt = 32 * c["num_warps"]
                report(f"HFMA2 {kern:7s} {label} N{c['BLOCK_N']} K{c['BLOCK_K']} w{c['num_warps']}", fn,
                       hptrs_gu if kern == "gate/up" else hptrs_dn, consts, c["num_warps"],
                       two * c["BLOCK_N"] * c["BLOCK_K"] // nt, two * c["BLOCK_N"] * K // nt, K // c["BLOCK_K"],
                       args.hist)


if __name__ == "__main__":
    main()
