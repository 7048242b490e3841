"""The streamed FMA GEMV path of ``dsv4_mtp::fp4_moe`` (``ops/triton/fp4_moe_stream.py``): under the
Triton CPU interpreter on small shapes (both formats, experts shared by tokens, several pipeline
depths), and (``-m gpu``) at V4 shapes against float64, with cp.async and TMA tiles, in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from .helpers import SM90_BUILD_PREAMBLE, run_under_triton_interpreter
from .test_fp4_moe_op import LIMIT, SHAPES, _reference_f64_gpu, check_graph_replay, make_experts, make_inputs, rel_err

INTERPRETER_SCRIPT = r"""
import torch
from dsv4_mtp_hf.ops.triton import persistent
from dsv4_mtp_hf.ops.triton.fp4_moe_triton import fp4_moe_triton
from tests.test_fp4_moe_op import make_experts, make_inputs, dense_f64, rel_err, LIMIT

E, D, I = 6, 256, 128
cfgs = [dict(gate_up=dict(BLOCK_N=16, BLOCK_K=64, STAGES=2, num_warps=4), down=dict(BLOCK_N=16, BLOCK_K=64, STAGES=3, num_warps=4)),
        dict(gate_up=dict(BLOCK_N=32, BLOCK_K=128, STAGES=1, num_warps=4), down=dict(BLOCK_N=32, BLOCK_K=128, STAGES=4, num_warps=4)),
        # both kernels in one launch (work counter, per-expert counts), tiles of different heights per phase
        dict(fused=True, gate_up=dict(BLOCK_N=16, BLOCK_K=64, STAGES=2, num_warps=4), down=dict(BLOCK_N=32, BLOCK_K=128, STAGES=3, num_warps=4))]
for fmt in ("nvfp4", "mxfp4"):
    W = make_experts(E, D, I, fmt, seed=3)
    for T, k in ((1, 4), (3, 2)):  # T=3, k=2 over 6 experts: some experts serve several tokens
        x, ids, rw = make_inputs(T, E, k, D, seed=T + 5)
        want = dense_f64(x, ids, rw, W, fmt)
        for i, cfg in enumerate(cfgs):
            if fmt == "mxfp4" and cfg["gate_up"]["BLOCK_K"] < 64:
                continue
            conf = dict(stream_min_tokens=1, stream_max_tokens=64, stream=cfg)
            out = fp4_moe_triton(x, ids, rw, *W, fmt, LIMIT, config=conf)
            # the token sums in the down kernel (tickets, the default): the same bits as the sum kernel
            assert torch.equal(out, fp4_moe_triton(x, ids, rw, *W, fmt, LIMIT, config=dict(conf, ticket_sum=False)))
            if cfg.get("fused"):  # the same bits as the two launches, the counters left at 0
                two = dict(conf, stream=dict(cfg, fused=False))
                assert torch.equal(out, fp4_moe_triton(x, ids, rw, *W, fmt, LIMIT, config=two))
                assert int(persistent._BUFFERS[("fp4_moe_stream_queue", "cpu")].abs().sum()) == 0
            err = rel_err(out, want)
            assert not torch.isnan(out).any() and err < 1e-2, (fmt, T, k, i, err)
print("OK")
"""


def test_stream_kernels_under_interpreter():
    """Both kernels, both formats, pipeline depths 1-4, and the two as one launch (the interpreter ignores the
    pipelining and runs the programs one after another, but runs every index, decode, reduction and counter as the
    GPU does), against float64."""
    run_under_triton_interpreter(INTERPRETER_SCRIPT, timeout=900)


def test_stream_config_errors():
    pytest.importorskip("triton")
    from dsv4_mtp_hf.ops.triton.fp4_moe_stream import launch_stream, stream_config, stream_supports

    assert stream_supports(4096, 2048) and stream_supports(7168, 3072)
    assert not stream_supports(4096, 2048, dict(gate_up=dict(BLOCK_K=3000)))
    assert stream_config(dict(down=dict(STAGES=5)))["down"]["BLOCK_N"] == 32
    W = make_experts(4, 256, 128, "nvfp4")
    x, ids, rw = make_inputs(1, 4, 2, 256)
    act, y = torch.empty(2, 128, dtype=torch.bfloat16), torch.empty(2, 256)
    for cfg, msg in ((dict(gate_up=dict(BLOCK_K=48)), "BLOCK_K a power of two"),
                     (dict(fused=True, down=dict(num_warps=2)), "the same num_warps"),
                     (dict(fused=True, fused_maxnreg=8), "fused_maxnreg None or 24..255")):
        with pytest.raises(ValueError, match=msg):
            launch_stream(x, ids.view(-1), rw.view(-1), *W, act, y, k=2, group_size=16, is_nv=True, limit=LIMIT,
                          use_asm=False, fold=False, cfg=cfg)


STREAM_CFGS = {
    "default": dict(),
    "tma": dict(tma=True),
    "n16s4": dict(gate_up=dict(BLOCK_N=16, STAGES=4), down=dict(BLOCK_N=16, STAGES=4)),
    "tma_k256": dict(tma=True, gate_up=dict(BLOCK_K=256, STAGES=4), down=dict(BLOCK_K=256, STAGES=4)),
    "fused": dict(fused=True),
    "fused_r128_dn64": dict(fused=True, fused_maxnreg=128, down=dict(BLOCK_N=64)),
    "fused_tma": dict(fused=True, tma=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("shape,T,k", [("flash", 1, 6), ("flash", 4, 6), ("pro", 3, 8)])
@pytest.mark.parametrize("cfg", sorted(STREAM_CFGS))
def test_stream_path_matches_f64(fmt, shape, T, k, cfg):
    """Against float64, NaN-poisoned output fully written, deterministic run to run."""
    from dsv4_mtp_hf.ops.triton.fp4_moe_triton import fp4_moe_triton

    E, D, I = SHAPES[shape]
    W = make_experts(E, D, I, fmt, device="cuda", seed=T * 10 + k)
    x, ids, rw = make_inputs(T, E, k, D, device="cuda", seed=T + k)
    conf = dict(stream_min_tokens=1, stream_max_tokens=64, stream=STREAM_CFGS[cfg])
    out = torch.full_like(x, float("nan"))
    out.copy_(fp4_moe_triton(x, ids, rw, *W, fmt, LIMIT, config=conf))
    again = fp4_moe_triton(x, ids.long(), rw, *W, fmt, LIMIT, config=conf)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    assert torch.equal(out, again)
    assert rel_err(out, _reference_f64_gpu(x, ids, rw, W, fmt)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("T", [1, 2, 5, 16])
def test_ticket_sum_equals_sum_kernel(fmt, T):
    """The default routing (stream / hmma by T) sums each token's rows in the down kernel: bit for bit the
    separate sum kernel's result, every element written, and the tickets left at 0 for the next call
    (three calls in a row on new inputs, each checked against the sum kernel)."""
    from dsv4_mtp_hf.ops.triton import moe_pairs
    from dsv4_mtp_hf.ops.triton.fp4_moe_triton import fp4_moe_triton

    E, D, I = SHAPES["flash"]
    W = make_experts(E, D, I, fmt, device="cuda", seed=T + 40)
    for i in range(3):
        x, ids, rw = make_inputs(T, E, 6, D, device="cuda", seed=T * 7 + i)
        out = torch.full_like(x, float("nan"))
        out.copy_(fp4_moe_triton(x, ids, rw, *W, fmt, LIMIT))
        want = fp4_moe_triton(x, ids, rw, *W, fmt, LIMIT, config=dict(ticket_sum=False))
        torch.cuda.synchronize()
        assert not torch.isnan(out).any() and torch.equal(out, want), (fmt, T, i)
    tickets = moe_pairs.sum_tickets(x.device, 1, 1)
    assert tickets is not None and int(tickets.abs().sum()) == 0


@pytest.mark.gpu
def test_ticket_sum_graph_captured_first():
    """A graph captured before any eager call allocated the tickets falls back to the sum kernel; the
    eager calls after it take the tickets; the graph still replays correctly on new inputs."""
    from dsv4_mtp_hf.ops.triton import persistent
    from dsv4_mtp_hf.ops.triton.fp4_moe_triton import fp4_moe_triton

    E, D, I = SHAPES["flash"]
    W = make_experts(E, D, I, "mxfp4", device="cuda", seed=31)
    x, ids, rw = make_inputs(1, E, 6, D, device="cuda", seed=32)
    key = ("fp4_moe_sum_tickets", str(x.device))
    out = torch.empty_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # compiles the kernels without taking tickets
        out.copy_(fp4_moe_triton(x, ids, rw, *W, "mxfp4", LIMIT, config=dict(ticket_sum=False)))
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    saved = persistent._BUFFERS.pop(key, None)
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out.copy_(fp4_moe_triton(x, ids, rw, *W, "mxfp4", LIMIT))
        assert key not in persistent._BUFFERS  # nothing allocated under capture
        eager = fp4_moe_triton(x, ids, rw, *W, "mxfp4", LIMIT)  # allocates the tickets
        assert key in persistent._BUFFERS
        for i in range(2):
            x2, ids2, rw2 = make_inputs(1, E, 6, D, device="cuda", seed=33 + i)
            x.copy_(x2), ids.copy_(ids2), rw.copy_(rw2)
            out.fill_(float("nan"))
            g.replay()
            eager = fp4_moe_triton(x, ids, rw, *W, "mxfp4", LIMIT)
            torch.cuda.synchronize()
            assert torch.equal(out, eager), i
            assert rel_err(out, _reference_f64_gpu(x, ids, rw, W, "mxfp4")) < 1e-2, i
    finally:
        if saved is not None and key not in persistent._BUFFERS:
            persistent._BUFFERS[key] = saved


@pytest.mark.gpu
@pytest.mark.parametrize("scfg", [dict(tma=False), dict(tma=True), dict(fused=True)])
def test_stream_path_cuda_graph_replay(scfg):
    from dsv4_mtp_hf.ops.triton.fp4_moe_triton import fp4_moe_triton

    conf = dict(stream_min_tokens=1, stream_max_tokens=64, stream=scfg)
    check_graph_replay(lambda *a: fp4_moe_triton(*a, config=conf), "nvfp4", seed=21, replays=2)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4])
def test_fused_stream_equals_two_launches(T):
    """One launch (``_fused_stream_kernel``) against the two kernels: the same bits, calls in a row on new inputs
    and routings (the counters reset by the last program every time), and a graph captured before the counters
    exist falls back to two launches and still replays correctly."""
    from dsv4_mtp_hf.ops.triton import persistent
    from dsv4_mtp_hf.ops.triton.fp4_moe_triton import fp4_moe_triton

    E, D, I = SHAPES["flash"]
    W = make_experts(E, D, I, "nvfp4", device="cuda", seed=T + 60)
    fused = dict(stream_min_tokens=1, stream_max_tokens=64, stream=dict(fused=True))
    two = dict(fused, stream=dict(fused=False))
    key = ("fp4_moe_stream_queue", "cuda:0")
    saved = persistent._BUFFERS.pop(key, None)
    try:
        x, ids, rw = make_inputs(T, E, 6, D, device="cuda", seed=T)
        out = torch.empty_like(x)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out.copy_(fp4_moe_triton(x, ids, rw, *W, "nvfp4", LIMIT, config=fused))
        assert key not in persistent._BUFFERS  # nothing allocated under capture: two launches recorded
        for i in range(3):
            x2, ids2, rw2 = make_inputs(T, E, 6, D, device="cuda", seed=T * 10 + i)
            x.copy_(x2), ids.copy_(ids2), rw.copy_(rw2)
            got = torch.full_like(x, float("nan"))
            got.copy_(fp4_moe_triton(x, ids, rw, *W, "nvfp4", LIMIT, config=fused))
            want = fp4_moe_triton(x, ids, rw, *W, "nvfp4", LIMIT, config=two)
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(got, want) and torch.equal(out, want), (T, i)
            assert int(persistent._BUFFERS[key].abs().sum()) == 0
    finally:
        if saved is not None:
            persistent._BUFFERS[key] = saved


@pytest.mark.parametrize("fmt,T,config,want", [
    ("nvfp4", 1, None, "stream"), ("nvfp4", 2, None, "stream"), ("mxfp4", 1, None, "stream"),  # the default ranges
    ("mxfp4", 2, None, "hmma"), ("nvfp4", 3, None, "hmma"), ("nvfp4", 6, None, "hmma"), ("nvfp4", 16, None, "hmma"),
    ("mxfp4", 4, None, "hmma"), ("mxfp4", 16, None, "hmma"), ("nvfp4", 17, None, "dot"), ("mxfp4", 17, None, "dot"),
    ("nvfp4", 1, dict(gemv_min_tokens=1, gemv_max_tokens=64), "gemv"),  # a caller's range wins over the default
    ("nvfp4", 2, dict(hgemv_min_tokens=1, hgemv_max_tokens=64), "hgemv"),
    ("nvfp4", 1, dict(stream_max_tokens=0), "dot"),
    ("mxfp4", 8, dict(hmma_max_tokens={"nvfp4": 16}), "dot"),  # a dict by format: a missing format is off
    ("nvfp4", 4, dict(stream_max_tokens={"nvfp4": 4, "mxfp4": 3}), "stream"),  # checked before hmma
])
def test_variant_routing(monkeypatch, fmt, T, config, want):
    """Which kernels ``fp4_moe_triton`` launches for T tokens (the launchers are replaced by recorders,
    so nothing runs)."""
    pytest.importorskip("triton")
    from dsv4_mtp_hf.ops.triton import fp4_moe_gemv, fp4_moe_hgemv, fp4_moe_hmma, fp4_moe_stream, fp4_moe_triton as tri

    class Launched(Exception):
        pass

    def recorder(name):
        def launch(*a, **k):
            raise Launched(name)
        return launch

    monkeypatch.setattr(fp4_moe_stream, "launch_stream", recorder("stream"))
    monkeypatch.setattr(fp4_moe_gemv, "launch_gemv", recorder("gemv"))
    monkeypatch.setattr(fp4_moe_hgemv, "launch_hgemv", recorder("hgemv"))
    monkeypatch.setattr(fp4_moe_hmma, "launch_hmma", recorder("hmma"))

    class DotLaunch:
        def __getitem__(self, grid):
            raise Launched("dot")

    monkeypatch.setattr(tri, "_gate_up_kernel", DotLaunch())
    W = make_experts(8, 1024, 512, fmt)
    x, ids, rw = make_inputs(T, 8, 2, 1024)
    with pytest.raises(Launched) as got:
        tri.fp4_moe_triton(x, ids, rw, *W, fmt, LIMIT, config=config)
    assert str(got.value) == want


# ----------------------------------------------------------------------------- CPU: sm_90 build
COMPILE_SCRIPT = SM90_BUILD_PREAMBLE + r"""
from dsv4_mtp_hf.ops.triton import fp4_moe_stream as st
cfg = st.stream_config()
for nv in (True, False):
    common = dict(I=2048, D=4096, PB=16, G=16 if nv else 32, IS_NV=nv, TMA=False, USE_ASM=True, FOLD=nv,
                  PROBE=False, PDL=2, w_desc=None)  # PDL as launched: wait, then trigger
    for kern, fn, ptrs, extra in (
            ("gate_up", st._gate_up_stream_kernel, {"xw_ptr": "*i32", "ids_ptr": "*i32", "rw_ptr": "*fp32", "w_ptr": "*i32",
                                                    "s_ptr": "*u8", "g_ptr": "*fp32", "act_ptr": "*bf16"}, dict(TOPK=6, LIMIT=10.0, NPASS=6)),
            ("down", st._down_stream_kernel, {"aw_ptr": "*i32", "ids_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*u8",
                                              "g_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*bf16", "tk_ptr": "*i32"},
             dict(TOPK=6, TICKET=True)),  # with the token sums (moe_pairs._ticket_sum), as launched by default
            ("fused", st._fused_stream_kernel,
             {"xw_ptr": "*i32", "ids_ptr": "*i32", "rw_ptr": "*fp32", "w13_ptr": "*i32", "s13_ptr": "*u8",
              "g13_ptr": "*fp32", "act_ptr": "*bf16", "aw_ptr": "*i32", "w2_ptr": "*i32", "s2_ptr": "*u8",
              "g2_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*bf16", "tk_ptr": "*i32", "q_ptr": "*i32"},
             dict(TOPK=6, LIMIT=10.0, NPASS=6, TICKET=True, w13_desc=None, w2_desc=None,
                  **{f"{p}_{kk}": cfg[kind][v] for p, kind in (("GU", "gate_up"), ("DN", "down"))
                     for kk, v in (("N", "BLOCK_N"), ("K", "BLOCK_K"), ("STAGES", "STAGES"))}))):
        if kern == "fused":
            consts = dict(common, **extra)
            consts.pop("w_desc")
            c = dict(num_warps=cfg["gate_up"]["num_warps"], maxnreg=cfg["fused_maxnreg"])
        else:
            c = cfg[kern]
            consts = dict(common, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], STAGES=c["STAGES"], **extra)
        k = sc.compile_kernel(fn, ptrs, consts, c["num_warps"], c.get("maxnreg"))
        sass, use = sc.sass_of(k)
        assert use.get("LOCAL", 0) == 0 and use.get("STACK", 0) == 0, (kern, nv, use)  # no spills under the cap
        if c.get("maxnreg"):
            assert use["REG"] <= c["maxnreg"], (kern, nv, use)
        assert "LDGSTS" in sass, (kern, nv)  # the K loop still pipelined into the ring
print("OK")
"""


def test_stream_kernels_build_for_sm90():
    """Offline sm_90 build (Triton's ptxas, no GPU) of the streamed gate/up and down kernels and the two as one
    launch at STREAM_CONFIG, both formats: no spills under their register caps (the down kernel's 80 fits one
    wave of programs at T=1), the K loop still asynchronous copies."""
    run_under_triton_interpreter(COMPILE_SCRIPT, timeout=600)
