#!/usr/bin/env python3
"""SASS instruction counts of the FP4 MoE GEMV / MMA kernels, compiled offline for sm_90 (no GPU needed):
the FMA GEMV (``fp4_moe_gemv``), the fp16x2 HFMA2 GEMV (``fp4_moe_hgemv``), the bf16 mma.sync kernels
(``fp4_moe_mma``) and the fp16 mma.sync kernels with fp32 block scales (``fp4_moe_hmma``).

    python benchmarks/sass_count.py [--hidden 4096 --inter 2048 --topk 6 --t 1] [--hist] [--kernels hmma,mma]

Needs Triton (its bundled ptxas / cuobjdump).  For each kernel and launch configuration it
prints registers, local memory (spills), and the static instruction count of the K loop
per weight a thread handles per K step, and of the whole pass over one token (K loop x steps
+ the rest of the pass: activation prescale, cross-lane reduction, epilogue) per weight of
the pass.  Static counts: the loop bodies are straight-line code, so they equal what one
thread issues per iteration.  For the MMA kernels the K loop is the innermost loop holding
HMMA instructions (the warp-divergence fallbacks of the epilogue's shuffles form loops too);
``fp4_moe_hmma``'s loop body is two K iterations (unrolled by two), and "loads@" gives where in
it the 16-byte loads (weights and activations) sit, as fractions of the body: ptxas decides that,
and a load just before its use hides no latency.
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


def compile_kernel(fn, ptrs: dict, consts: dict, num_warps: int, maxnreg: int | None = None):
    """The compiled kernel (``.asm`` holds ttgir, ptx, cubin)."""
    sig = {n: ptrs.get(n) or ("i32" if n == "P" else "constexpr") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs}  # as the JIT specialises
    opts = dict(num_warps=num_warps, num_stages=1, **({"maxnreg": maxnreg} if maxnreg else {}))
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=opts)


def compile_sass(fn, ptrs: dict, consts: dict, num_warps: int, maxnreg: int | None = None):
    return sass_of(compile_kernel(fn, ptrs, consts, num_warps, maxnreg))


def sass_of(k):
    """(SASS text, {"REG", "LOCAL", "STACK"}) of a compiled kernel."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as fh:
            fh.write(k.asm["cubin"])
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
    usage = dict(re.findall(r"(REG|LOCAL|STACK):(\d+)", res))
    return sass, {k: int(v) for k, v in usage.items()}


def loop_counts(sass: str, marker: str | None = None):
    """(innermost loop body, its enclosing loop body) as lists of instructions; with ``marker``
    the innermost loop that holds an instruction starting with it."""
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
    if marker:
        loops = [lp for lp in loops if any(lp[0] <= a <= lp[1] and t.startswith(marker) for a, t in ins)]
    inner = min((lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)),
                key=lambda lp: lp[1] - lp[0])
    outer = min((lp for lp in loops if lp != inner and lp[0] <= inner[0] and inner[1] <= lp[1]),
                key=lambda lp: lp[1] - lp[0], default=None)

    def body(lp):
        return [t for a, t in ins if lp[0] <= a <= lp[1]] if lp else []

    return body(inner), body(outer)


def hist(body):
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in body)


def report(name, fn, ptrs, consts, num_warps, w_step, w_pass, nk, show_hist, marker=None, maxnreg=None):
    try:
        sass, use = compile_sass(fn, ptrs, consts, num_warps, maxnreg)
    except Exception as err:  # noqa: BLE001
        print(f"{name:34s} FAILED: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
        return
    inner, outer = loop_counts(sass, marker)
    unrolled = "STG" in " ".join(hist(inner))  # no K loop left (short K fully unrolled): this is the pass
    per_pass = (len(outer) - len(inner)) + nk * len(inner) if outer and not unrolled else None
    loads = ""
    if marker:
        at = [i for i, t in enumerate(inner) if t.startswith("LDG.E.128")]
        loads = "  loads@" + ",".join(f"{i / len(inner):.2f}" for i in at) if len(at) <= 24 else ""
    print(f"{name:34s} regs {use.get('REG', 0):3d}  local(spill) {use.get('LOCAL', 0):4d} B  "
          + (f"K loop unrolled into the pass: {len(inner) / w_pass:5.2f}/w" if unrolled else
             f"K loop {len(inner):5d} instr / {w_step:4d} w = {len(inner) / w_step:5.2f}/w   "
             f"pass {'%.2f' % (per_pass / w_pass) if per_pass else '-':>5s}/w") + loads)
    if show_hist:
        print("    K loop:", ", ".join(f"{k} {v}" for k, v in hist(inner).most_common()))


def hmma_kernel_args(kern: str, D: int, I: int, nv: bool, cfg: dict, topk: int = 6, pb: int = 16):
    """(kernel, pointer types, constexprs, warps, weights per K-loop body, weights per pass, K-loop trips)
    of one ``fp4_moe_hmma`` kernel ("gate_up" / "down") as ``launch_hmma`` runs it."""
    from dsv4_mtp_hf.ops.triton import fp4_moe_hmma as hm

    gu = kern == "gate_up"
    c = cfg[kern]
    nw, ks, ns = c["num_warps"], c["ksplit"], c["nsub"]
    K = D if gu else I
    wld, sld, xld = hm.load_asms(kern, K, I if gu else 8 * (nw // ks), nv, cfg)
    consts = dict(I=I, D=D, PB=pb, IS_NV=nv, NW=nw, KSPLIT=ks, NSUB=ns, PF=cfg["prefetch"], WLD=wld, SLD=sld, XLD=xld,
                  USE_ASM=True, STAGES=cfg.get("stages", 3), SHARE=bool(cfg.get("share", False)),
                  TILES_FIRST=bool(cfg.get("tiles_first", False)), PROBE=bool(cfg.get("probe", False)))
    if gu:
        ptrs = {"xh_ptr": "*fp16", "xs_ptr": "*i32", "ids_ptr": "*i32", "w_ptr": "*u8", "s_ptr": "*u8",
                "g_ptr": "*fp32", "act_ptr": "*fp16"}
        consts.update(TOPK=topk, LIMIT=10.0, ASCALE=512.0)
    else:
        ptrs = {"act_ptr": "*fp16", "ids_ptr": "*i32", "rw_ptr": "*fp32", "w_ptr": "*u8", "s_ptr": "*u8",
                "g_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*bf16", "tk_ptr": "*i32"}
        consts.update(YSCALE=32.0, TOPK=topk, TICKET=True)  # the token sums in the kernel, as launched by default
    nit = K // (32 * 4 * ks * ns)
    pf1 = cfg["prefetch"] == 1  # the K loop unrolled by two
    return (hm._gate_up_hmma_kernel if gu else hm._down_hmma_kernel, ptrs, consts, nw, (2 if pf1 else 1) * ns * 64,
            2 * K // (4 * ks), nit // 2 if pf1 else nit)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--t", type=int, default=1, help="tokens (sets the pass count P = T * topk)")
    ap.add_argument("--hist", action="store_true", help="also print the K loop's instruction histogram")
    ap.add_argument("--kernels", default="gemv,hgemv,mma,hmma", help="comma list of kernel families")
    args = ap.parse_args()
    fams = set(args.kernels.split(","))
    from dsv4_mtp_hf.ops.triton import fp4_moe_gemv as gv
    from dsv4_mtp_hf.ops.triton import fp4_moe_hgemv as hg
    from dsv4_mtp_hf.ops.triton import fp4_moe_hmma as hm
    from dsv4_mtp_hf.ops.triton import fp4_moe_mma as mm

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
        for label, bn_gu, bn_dn in (("gv16 (default)", 16, 32), ("gv32", 32, 32)) if "gemv" in fams else ():
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
        for label, over in variants if "hgemv" in fams else ():
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
        # bf16 mma.sync (fp4_moe_mma): per lane 64 bytes of each of two rows per K iteration
        mptrs_gu = {"xw_ptr": "*i32", "xe_ptr": "*bf16", "ids_ptr": "*i32", "rw_ptr": "*fp32", "w_ptr": "*i32",
                    "s_ptr": "*u8", "g_ptr": "*fp32", "act_ptr": "*bf16"}
        mptrs_dn = {"aw_ptr": "*i32", "ae_ptr": "*bf16", "ids_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*u8",
                    "g_ptr": "*fp32", "y_ptr": "*fp32"}
        for label, over in (("default", {}), ("pf2", dict(prefetch=2))) if "mma" in fams else ():
            cfg = {**mm.MMA_CONFIG, **over}
            for kern in ("gate/up", "down"):
                gu = kern == "gate/up"
                nw, ks = (cfg["gate_up_warps"], cfg["gate_up_ksplit"]) if gu else (cfg["down_warps"], cfg["down_ksplit"])
                K = D if gu else I
                consts = dict(common, G=G, IS_NV=nv, NW=nw, KSPLIT=ks, USE_ASM=True, PF=cfg["prefetch"])
                if gu:
                    consts.update(TOPK=args.topk, LIMIT=10.0)
                report(f"MMA bf16 {kern:7s} {label} w{nw}k{ks}", mm._gate_up_mma_kernel if gu else mm._down_mma_kernel,
                       mptrs_gu if gu else mptrs_dn, consts, nw, 256, 2 * K // (4 * ks), K // (512 * ks), args.hist,
                       marker="HMMA")
        # fp16 mma.sync, fp32 block scales (fp4_moe_hmma)
        hm_variants = [("default", {}), ("maxnreg free", dict(maxnreg=None)), ("nsub1", dict(gate_up=dict(nsub=1),
                       down=dict(nsub=1))), ("nsub4 r232", dict(gate_up=dict(nsub=4), down=dict(nsub=4), maxnreg=232)),
                       ("pf2", dict(prefetch=2)), ("w8k2", dict(gate_up=dict(num_warps=8, ksplit=2),
                                                                down=dict(num_warps=8, ksplit=2)))]
        for label, over in hm_variants if "hmma" in fams else ():
            cfg = hm.hmma_config(over)
            if not hm.hmma_supports(D, I, cfg):
                print(f"HMMA f16 {label}: does not tile D={D} I={I}")
                continue
            for kern in ("gate_up", "down"):
                fn, ptrs, consts, nw, w_body, w_pass, nk = hmma_kernel_args(kern, D, I, nv, cfg, args.topk, pb)
                c = cfg[kern]
                report(f"HMMA f16 {kern.replace('_', '/'):7s} {label} w{nw}k{c['ksplit']}n{c['nsub']}", fn, ptrs, consts,
                       nw, w_body, w_pass, nk, args.hist, marker="HMMA", maxnreg=cfg["maxnreg"])


if __name__ == "__main__":
    main()
