"""``dsv4_mtp::fp4_moe``: the CPU reference against a dense float64 computation, input
validation, and (``-m gpu``) the Triton CUDA kernel against float64."""

from __future__ import annotations

import pytest
import torch

from dsv4_mtp_hf import fp4
from dsv4_mtp_hf.ops import check_fp4_moe_inputs, fp4_moe, fp4_moe_reference

LIMIT = 10.0


def make_experts(E, D, I, fmt, device="cpu", seed=0):
    """Random packed codes and scale bytes, sized so the SwiGLU clamp is sometimes active."""
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randint(0, 256, (E, 2 * I, D // 2), dtype=torch.uint8, device=device, generator=g)
    w2 = torch.randint(0, 256, (E, D, I // 2), dtype=torch.uint8, device=device, generator=g)
    if fmt == "nvfp4":
        def sc(shape):
            return (torch.rand(shape, device=device, generator=g) * 7 + 1).to(torch.float8_e4m3fn).view(torch.uint8)

        s13, s2 = sc((E, 2 * I, D // 16)), sc((E, D, I // 16))
        # per-matrix globals, chosen so a few per cent of gates exceed the limit
        g13 = (torch.rand(E, 2, device=device, generator=g) + 1.0) * (0.3 / D**0.5)
        g2 = (torch.rand(E, device=device, generator=g) + 1.0) * (0.02 / I**0.5)
    else:
        s13 = torch.randint(126, 129, (E, 2 * I, D // 32), dtype=torch.uint8, device=device, generator=g)
        s13 -= int(round(torch.log2(torch.tensor(D**0.5)).item()))
        s2 = torch.randint(118, 121, (E, D, I // 32), dtype=torch.uint8, device=device, generator=g)
        s2 -= int(round(torch.log2(torch.tensor(I**0.5)).item()))
        g13, g2 = torch.ones(E, 2, device=device), torch.ones(E, device=device)
    return w13, s13, g13.float(), w2, s2, g2.float()


def make_inputs(T, E, k, D, device="cpu", seed=1):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, D, device=device, generator=g).to(torch.bfloat16)
    ids = torch.rand(T, E, device=device, generator=g).topk(k, dim=1).indices.to(torch.int32)
    w = torch.rand(T, k, device=device, generator=g) + 0.05
    return x, ids, (w / w.sum(1, keepdim=True) * 1.5).float()


def dense_f64(x, ids, rw, W, fmt):
    """Every token through its experts one by one, float64 throughout."""
    w13, s13, g13, w2, s2, g2 = W
    inter = w2.shape[-1] * 2
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            a = fp4.dequantize_fp4(w13[e], s13[e], fmt, dtype=torch.float64)
            gate = (a[:inter] @ x[t].double()) * g13[e, 0].double()
            up = (a[inter:] @ x[t].double()) * g13[e, 1].double()
            act = torch.nn.functional.silu(gate.clamp(max=LIMIT)) * up.clamp(-LIMIT, LIMIT)
            down = fp4.dequantize_fp4(w2[e], s2[e], fmt, dtype=torch.float64) * g2[e].double()
            out[t] += down @ (act * float(rw[t, j]))
    return out


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ----------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("T,k", [(1, 6), (5, 4), (9, 8)])
def test_reference_matches_dense_f64(fmt, T, k):
    E, D, I = 12, 128, 64
    W = make_experts(E, D, I, fmt, seed=T)
    x, ids, rw = make_inputs(T, E, k, D, seed=100 + T)
    want = dense_f64(x, ids, rw, W, fmt)
    assert want.abs().max() > 0
    # the reference returns x.dtype; fp32 activations keep its own (fp32) rounding visible
    got = fp4_moe_reference(x.float(), ids, rw, *W, fmt, LIMIT)
    assert got.dtype == torch.float32
    assert rel_err(got, want) < 1e-5
    # through the registered op (CPU dispatch) with bf16 activations
    out = fp4_moe(x, ids, rw, *W, fmt, LIMIT)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert rel_err(out, want) < 1e-2


def test_clamp_is_exercised():
    E, D, I = 4, 128, 64
    W = make_experts(E, D, I, "nvfp4", seed=3)
    x, ids, rw = make_inputs(16, E, 2, D, seed=4)
    w13, s13, g13 = W[:3]
    a = fp4.dequantize_fp4(w13[0], s13[0], "nvfp4", dtype=torch.float64)
    gate = x.double() @ a[:I].t() * g13[0, 0].double()
    assert 0 < (gate > LIMIT).double().mean() < 0.5


def test_input_validation():
    E, D, I = 4, 64, 32
    W = list(make_experts(E, D, I, "nvfp4"))
    x, ids, rw = make_inputs(2, E, 2, D)
    check_fp4_moe_inputs(x, ids, rw, *W, "nvfp4")
    with pytest.raises(ValueError, match="hidden size"):
        check_fp4_moe_inputs(x[:, :32], ids, rw, *W, "nvfp4")
    with pytest.raises(ValueError, match="scale shapes"):
        check_fp4_moe_inputs(x, ids, rw, *W, "mxfp4")
    with pytest.raises(ValueError, match="Unknown FP4"):
        check_fp4_moe_inputs(x, ids, rw, *W, "fp4x")
    with pytest.raises(ValueError, match="must both be"):
        check_fp4_moe_inputs(x, ids[:1], rw[:1], *W, "nvfp4")
    with pytest.raises(TypeError, match="integer expert ids"):
        check_fp4_moe_inputs(x, ids.float(), rw, *W, "nvfp4")
    bad = list(W)
    bad[0] = bad[0].view(torch.int8)
    with pytest.raises(TypeError, match="uint8"):
        check_fp4_moe_inputs(x, ids, rw, *bad, "nvfp4")
    bad = list(W)
    bad[2] = bad[2][:, :1]
    with pytest.raises(ValueError, match="global scales"):
        check_fp4_moe_inputs(x, ids, rw, *bad, "nvfp4")


def _run_decode_ptx(body: str, word: int) -> dict:
    """Interpret the few PTX instructions of ``DECODE_BODY`` (prmt with an immediate
    selector, and.b32, mul.lo.u32) on one 32-bit word of four packed bytes."""
    regs = {"$4": word}

    def val(tok):
        return regs[tok] if tok in regs else int(tok, 0)

    for line in body.strip().splitlines():
        op, rest = line.strip().rstrip(";").split(None, 1)
        args = [a.strip() for a in rest.split(",")]
        if op == "prmt.b32":
            src = val(args[1]) | (val(args[2]) << 32)  # bytes 0-3 from a, 4-7 from b
            sel, out = val(args[3]), 0
            for i in range(4):
                nib = (sel >> (4 * i)) & 15
                byte = (src >> (8 * (nib & 7))) & 255
                if nib & 8:  # sign-replicate mode (unused here)
                    byte = 255 if byte & 128 else 0
                out |= byte << (8 * i)
        elif op == "and.b32":
            out = val(args[1]) & val(args[2])
        elif op == "mul.lo.u32":
            out = (val(args[1]) * val(args[2])) & 0xFFFFFFFF
        else:
            raise AssertionError(f"unexpected PTX op {op}")
        regs[args[0]] = out
    return regs


def test_decode_ptx_bits_exact():
    """The Triton kernels' PTX decode: every e2m1 code in every byte lane gives the bf16
    bits of its value times 2**-126 (the kernels multiply back by 2**126, or fold it)."""
    from dsv4_mtp_hf.ops.triton import decode_ptx

    def want_bits(code):  # bf16 of e2m1(code) * 2**-126, computed the slow way
        v = torch.tensor(fp4.E2M1_VALUES[code & 7] * (-1.0 if code & 8 else 1.0), dtype=torch.float64)
        v = (v * 2.0**-126).to(torch.float32)
        bits = int(v.view(torch.int32).item()) & 0xFFFFFFFF
        assert bits & 0xFFFF == 0  # exactly representable in bf16
        return bits >> 16

    g = torch.Generator().manual_seed(0)
    words = [b | (b << 8) | (b << 16) | (b << 24) for b in range(256)]
    words += torch.randint(0, 2**32, (256,), generator=g, dtype=torch.int64).tolist()
    for w in words:
        r = _run_decode_ptx(decode_ptx.DECODE_BODY, w)
        b = [(w >> (8 * i)) & 255 for i in range(4)]
        lo = [want_bits(x & 15) for x in b]
        hi = [want_bits(x >> 4) for x in b]
        assert r["r0"] == lo[0] | lo[1] << 16 and r["r1"] == lo[2] | lo[3] << 16, hex(w)
        assert r["r2"] == hi[0] | hi[1] << 16 and r["r3"] == hi[2] | hi[3] << 16, hex(w)
    # both variants run the same body; only the tail differs (x 2**126, or raw for "fold")
    assert decode_ptx.DECODE_BODY in decode_ptx.DECODE_ASM and decode_ptx.DECODE_BODY in decode_ptx.DECODE_ASM_RAW
    assert "0x7E807E80" in decode_ptx.DECODE_ASM  # bf16x2 2**126


def test_decode8_f32_ptx_bits_exact():
    """The GEMV kernels' PTX decode (one int32 word -> 8 fp32): $0-$3 are the low nibbles of
    bytes 0-3 and $4-$7 the high nibbles, each the fp32 bits of e2m1 x 2**-126 (RAW)."""
    from dsv4_mtp_hf.ops.triton import decode_ptx

    def want_bits(code):
        v = torch.tensor(fp4.E2M1_VALUES[code & 7] * (-1.0 if code & 8 else 1.0), dtype=torch.float64)
        return int((v * 2.0**-126).to(torch.float32).view(torch.int32).item()) & 0xFFFFFFFF

    asm = decode_ptx.DECODE8_F32_RAW
    body = asm[asm.index("prmt"):asm.rindex("}")]
    g = torch.Generator().manual_seed(1)
    words = [b | (b << 8) | (b << 16) | (b << 24) for b in range(256)]
    words += torch.randint(0, 2**32, (256,), generator=g, dtype=torch.int64).tolist()
    for w in words:
        regs = {"$8": w}
        for line in filter(str.strip, body.splitlines()):
            op, rest = line.strip().rstrip(";").split(None, 1)
            a = [x.strip() for x in rest.split(",")]
            v = [regs[t] if t in regs else int(t, 0) for t in a[1:]]
            if op == "prmt.b32":
                src, out = v[0] | (v[1] << 32), 0
                for i in range(4):
                    out |= ((src >> (8 * ((v[2] >> (4 * i)) & 7))) & 255) << (8 * i)
            elif op == "and.b32":
                out = v[0] & v[1]
            elif op == "mul.lo.u32":
                out = (v[0] * v[1]) & 0xFFFFFFFF
            elif op == "shl.b32":
                out = (v[0] << v[1]) & 0xFFFFFFFF
            else:
                raise AssertionError(f"unexpected PTX op {op}")
            regs[a[0]] = out
        b = [(w >> (8 * i)) & 255 for i in range(4)]
        assert [regs[f"${i}"] for i in range(4)] == [want_bits(x & 15) for x in b], hex(w)
        assert [regs[f"${i}"] for i in range(4, 8)] == [want_bits(x >> 4) for x in b], hex(w)
    # the non-fold variant runs the same decode, then x 2**126 in bf16 (as DECODE_ASM)
    core = decode_ptx.DECODE_BODY.replace("$4", "$8")
    assert core in decode_ptx.DECODE8_F32 and core in decode_ptx.DECODE8_F32_RAW
    assert "fma.rn.bf16x2 r0, r0, c126, nz;" in decode_ptx.DECODE8_F32


def test_package_imports_without_triton_on_cpu():
    import dsv4_mtp_hf.ops as ops

    assert callable(ops.fp4_moe) and callable(ops.register_cuda_kernels)


# ----------------------------------------------------------------------------- GPU
SHAPES = {"flash": (16, 4096, 2048), "pro": (8, 7168, 3072)}


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("shape", ["flash", "pro"])
@pytest.mark.parametrize("T,k", [(1, 6), (3, 8), (16, 6), (64, 8), (64, 6)])
def test_triton_matches_f64(fmt, shape, T, k):
    from dsv4_mtp_hf.ops.triton.fp4_moe_triton import fp4_moe_triton

    E, D, I = SHAPES[shape]
    if k > E:
        pytest.skip("top-k larger than the expert count")
    W = make_experts(E, D, I, fmt, device="cuda", seed=T * 10 + k)
    x, ids, rw = make_inputs(T, E, k, D, device="cuda", seed=T + k)
    want = _reference_f64_gpu(x, ids, rw, W, fmt)
    out = torch.full_like(x, float("nan"))
    out.copy_(fp4_moe(x, ids, rw, *W, fmt, LIMIT))  # dispatches to the Triton kernel
    direct = fp4_moe_triton(x, ids, rw, *W, fmt, LIMIT)
    mma = torch.full_like(x, float("nan"))
    mma.copy_(fp4_moe_triton(x, ids, rw, *W, fmt, LIMIT, config=dict(mma_max_tokens=64)))  # opt-in mma.sync path
    torch.cuda.synchronize()
    assert not torch.isnan(out).any() and not torch.isnan(direct).any() and not torch.isnan(mma).any()
    assert torch.equal(out, direct)  # the op is registered for CUDA and deterministic
    assert rel_err(out, want) < 1e-2
    assert rel_err(mma, want) < 1e-2
    # the router's int64 ids go to the kernels as they are (no conversion): same bits
    assert torch.equal(fp4_moe(x, ids.long(), rw, *W, fmt, LIMIT), out)
    assert torch.equal(fp4_moe_triton(x, ids.long(), rw, *W, fmt, LIMIT, config=dict(mma_max_tokens=64)), mma)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("mma", [dict(), dict(gate_up_warps=8, gate_up_ksplit=2, down_warps=8, down_ksplit=4),
                                 dict(gate_up_warps=2, down_warps=2, prefetch=2)])
def test_mma_path_many_tokens_on_one_expert(fmt, mma):
    """More than 8 tokens on one expert: the mma.sync kernels take them 8 MMA columns
    at a time (3 passes here); warp and K-split variants give the same function."""
    from dsv4_mtp_hf.ops.triton.fp4_moe_triton import fp4_moe_triton

    E, D, I = SHAPES["flash"]
    W = make_experts(E, D, I, fmt, device="cuda", seed=11)
    x, ids, rw = make_inputs(20, E, 2, D, device="cuda", seed=12)
    ids[:, 1] = 3
    ids[:, 0] = torch.where(ids[:, 0] == 3, 4, ids[:, 0])
    out = torch.full_like(x, float("nan"))
    out.copy_(fp4_moe_triton(x, ids, rw, *W, fmt, LIMIT, config=dict(mma_max_tokens=64, mma=mma)))
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    assert rel_err(out, _reference_f64_gpu(x, ids, rw, W, fmt)) < 1e-2


GEMV_CFGS = {
    "m1": dict(gemv_min_tokens=1, gemv_max_tokens=64),
    "m2pf2": dict(gemv_min_tokens=1, gemv_max_tokens=64,
                  gemv=dict(gate_up=dict(BLOCK_N=8, BLOCK_K=512, M=2, PF=2, num_warps=4),
                            down=dict(BLOCK_N=16, BLOCK_K=512, M=2, PF=2, num_warps=4))),
    "n32pf2": dict(gemv_min_tokens=1, gemv_max_tokens=64,
                   gemv=dict(gate_up=dict(BLOCK_N=32, BLOCK_K=512, M=1, PF=2, num_warps=4),
                             down=dict(BLOCK_N=32, BLOCK_K=512, M=1, PF=2, num_warps=4))),
}


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("shape,T,k", [("flash", 1, 6), ("flash", 16, 6), ("pro", 3, 8)])
@pytest.mark.parametrize("cfg", sorted(GEMV_CFGS))
def test_gemv_path_matches_f64(fmt, shape, T, k, cfg):
    """The FMA GEMV kernels (``fp4_moe_gemv``) against float64, deterministic run to run."""
    from dsv4_mtp_hf.ops.triton.fp4_moe_triton import fp4_moe_triton

    E, D, I = SHAPES[shape]
    W = make_experts(E, D, I, fmt, device="cuda", seed=T * 10 + k)
    x, ids, rw = make_inputs(T, E, k, D, device="cuda", seed=T + k)
    out = torch.full_like(x, float("nan"))
    out.copy_(fp4_moe_triton(x, ids, rw, *W, fmt, LIMIT, config=GEMV_CFGS[cfg]))
    again = fp4_moe_triton(x, ids, rw, *W, fmt, LIMIT, config=GEMV_CFGS[cfg])
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    assert torch.equal(out, again)
    assert rel_err(out, _reference_f64_gpu(x, ids, rw, W, fmt)) < 1e-2


def check_graph_replay(moe, fmt, seed, replays=3):
    """``moe(x, ids, rw, *W, fmt, LIMIT)`` captured in a CUDA graph at V4-Flash size (T=4): replays on
    new inputs copied into the captured buffers write every output element (NaN-poisoned first)
    and match the float64 reference."""
    E, D, I = SHAPES["flash"]
    W = make_experts(E, D, I, fmt, device="cuda", seed=seed)
    x, ids, rw = make_inputs(4, E, 6, D, device="cuda", seed=seed + 1)
    out = torch.full_like(x, float("nan"))

    def step():
        out.copy_(moe(x, ids, rw, *W, fmt, LIMIT))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for i in range(replays):  # new inputs into the captured buffers
        x2, ids2, rw2 = make_inputs(4, E, 6, D, device="cuda", seed=seed + 2 + i)
        x.copy_(x2), ids.copy_(ids2), rw.copy_(rw2)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert not torch.isnan(out).any(), seed
        assert rel_err(out, _reference_f64_gpu(x, ids, rw, W, fmt)) < 1e-2, seed


@pytest.mark.gpu
def test_triton_cuda_graph_replay():
    check_graph_replay(fp4_moe, "nvfp4", seed=7, replays=2)


def _reference_f64_gpu(x, ids, rw, W, fmt):
    """Float64 reference on the GPU, grouped by expert (the dense loop is too slow at D=7168)."""
    w13, s13, g13, w2, s2, g2 = W
    inter = w2.shape[-1] * 2
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        a = fp4.dequantize_fp4(w13[e], s13[e], fmt, dtype=torch.float64)
        gu = x[tok].double() @ a.t()
        gate = (gu[:, :inter] * g13[e, 0].double()).clamp(max=LIMIT)
        up = (gu[:, inter:] * g13[e, 1].double()).clamp(-LIMIT, LIMIT)
        act = torch.nn.functional.silu(gate) * up * rw[tok, slot].double().unsqueeze(-1)
        down = fp4.dequantize_fp4(w2[e], s2[e], fmt, dtype=torch.float64) * g2[e].double()
        out.index_add_(0, tok, act @ down.t())
    return out


# ----------------------------------------------------------------------------- PTX (CPU)
def _bf16_bits(v: float) -> int:
    return int(torch.tensor(v, dtype=torch.float64).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF


def _bf16_val(bits: int) -> float:
    return torch.tensor([bits & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).double().item()


def _f32_bits(v: float) -> int:
    return int(torch.tensor(v, dtype=torch.float64).to(torch.float32).view(torch.int32).item()) & 0xFFFFFFFF


def _f32_val(bits: int) -> float:
    return torch.tensor([bits & 0xFFFFFFFF], dtype=torch.int64).to(torch.int32).view(torch.float32).double().item()


def run_warp_ptx(asm: str, operands: list[list[int]]) -> list[list[int]]:
    """Interpret the PTX subset of ``mma_ptx.mma_asm`` for the 32 lanes of one warp.

    ``operands[lane][i]`` is the 32-bit value of ``$i`` (outputs included); returns them
    after the block.  mma.sync follows the PTX ISA fragment layouts of m16n8k16 (bf16)."""
    body = [s.strip() for s in asm.replace("{\n", "\n").split(";")]
    regs = [dict() for _ in range(32)]

    def val(lane, tok):
        tok = tok.strip()
        if tok.startswith("$"):
            return operands[lane][int(tok[1:])]
        if tok.startswith("0f"):
            return int(tok[2:], 16)
        if tok[0].isdigit() or tok.startswith("-"):
            return int(tok, 0) & 0xFFFFFFFF
        return regs[lane][tok]

    def put(lane, tok, v):
        tok = tok.strip()
        if tok.startswith("$"):
            operands[lane][int(tok[1:])] = v & 0xFFFFFFFF
        else:
            regs[lane][tok] = v

    def vec(s):
        return [t.strip() for t in s.strip().strip("{}").split(",")]

    for stmt in body:
        stmt = stmt.strip().lstrip("{").strip()
        if not stmt or stmt.startswith(".reg") or stmt == "}":
            continue
        op, rest = stmt.split(None, 1)
        if op.startswith("mma.sync"):
            parts = [p + "}" for p in rest.split("}") if p.strip(" ,")]
            d, a, b, c = (vec(p.strip(" ,")) for p in parts)
            A = [[0.0] * 16 for _ in range(16)]
            B = [[0.0] * 8 for _ in range(16)]
            C = [[0.0] * 8 for _ in range(16)]
            for lane in range(32):
                g, q = lane >> 2, lane & 3
                av = [val(lane, r) for r in a]
                bv = [val(lane, r) for r in b]
                cv = [val(lane, r) for r in c]
                for i, (row, k0) in enumerate(((g, 2 * q), (g + 8, 2 * q), (g, 2 * q + 8), (g + 8, 2 * q + 8))):
                    A[row][k0] = _bf16_val(av[i])
                    A[row][k0 + 1] = _bf16_val(av[i] >> 16)
                for i, k0 in enumerate((2 * q, 2 * q + 8)):
                    B[k0][g] = _bf16_val(bv[i])
                    B[k0 + 1][g] = _bf16_val(bv[i] >> 16)
                for i, (row, col) in enumerate(((g, 2 * q), (g, 2 * q + 1), (g + 8, 2 * q), (g + 8, 2 * q + 1))):
                    C[row][col] = _f32_val(cv[i])
            for lane in range(32):
                g, q = lane >> 2, lane & 3
                for i, (row, col) in enumerate(((g, 2 * q), (g, 2 * q + 1), (g + 8, 2 * q), (g + 8, 2 * q + 1))):
                    acc = C[row][col] + sum(A[row][kk] * B[kk][col] for kk in range(16))
                    put(lane, d[i], _f32_bits(acc))
            continue
        args = [t.strip() for t in rest.split(",")] if not rest.strip().startswith("{") else None
        for lane in range(32):
            if op == "mov.b32" and rest.strip().startswith("{"):
                dst, src = rest.split("}")
                lo, hi = vec(dst + "}")
                v = val(lane, src.strip(" ,"))
                put(lane, lo, v & 0xFFFF)
                put(lane, hi, (v >> 16) & 0xFFFF)
                continue
            if op == "mov.b32":
                put(lane, args[0], val(lane, args[1]))
            elif op == "prmt.b32":
                src = val(lane, args[1]) | (val(lane, args[2]) << 32)
                sel, out = val(lane, args[3]), 0
                for i in range(4):
                    out |= ((src >> (8 * ((sel >> (4 * i)) & 7))) & 255) << (8 * i)
                put(lane, args[0], out)
            elif op == "and.b32":
                put(lane, args[0], val(lane, args[1]) & val(lane, args[2]))
            elif op == "shr.b32":
                put(lane, args[0], val(lane, args[1]) >> val(lane, args[2]))
            elif op == "shl.b32":
                put(lane, args[0], (val(lane, args[1]) << val(lane, args[2])) & 0xFFFFFFFF)
            elif op == "max.u32":
                put(lane, args[0], max(val(lane, args[1]), val(lane, args[2])))
            elif op == "mul.lo.u32":
                put(lane, args[0], (val(lane, args[1]) * val(lane, args[2])) & 0xFFFFFFFF)
            elif op == "cvt.rn.f16x2.e4m3x2":
                h = val(lane, args[1])
                by = torch.tensor([h & 255, (h >> 8) & 255], dtype=torch.uint8).view(torch.float8_e4m3fn)
                f = by.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
                put(lane, args[0], int(f[0]) | (int(f[1]) << 16))
            elif op == "cvt.f32.f16":
                h = torch.tensor([val(lane, args[1])], dtype=torch.int32).to(torch.int16).view(torch.float16)
                put(lane, args[0], _f32_bits(h.double().item()))
            elif op == "mul.f32":
                put(lane, args[0], _f32_bits(_f32_val(val(lane, args[1])) * _f32_val(val(lane, args[2]))))
            elif op == "cvt.rn.bf16x2.f32":
                put(lane, args[0], (_bf16_bits(_f32_val(val(lane, args[1]))) << 16) | _bf16_bits(_f32_val(val(lane, args[2]))))
            elif op == "fma.rn.bf16x2":
                a, b, c = (val(lane, r) for r in args[1:])
                out = 0
                for sh in (0, 16):
                    out |= _bf16_bits(_bf16_val(a >> sh) * _bf16_val(b >> sh) + _bf16_val(c >> sh)) << sh
                put(lane, args[0], out)
            else:
                raise AssertionError(f"unexpected PTX op {op}")
    return operands


@pytest.mark.parametrize("fmt,sub", [("nvfp4", 0), ("nvfp4", 1), ("mxfp4", 0), ("mxfp4", 3)])
def test_mma_ptx_matches_lane_dot_products(fmt, sub):
    """The small-batch kernels' asm (decode, scale, mma.sync on one 16-byte sub-window),
    interpreted for a whole warp: each lane's accumulators must equal the dot products of
    its lane group's two weight rows with the activations of token columns 2q and 2q+1,
    summed over the four K quarters (lanes)."""
    from dsv4_mtp_hf.ops.triton import mma_ptx

    g = torch.Generator().manual_seed(5 + sub)
    asm = mma_ptx.mma_asm(fmt, sub)
    words = torch.randint(0, 2**32, (32, 2, 4), generator=g, dtype=torch.int64)  # lane, row a/b, word
    xs = (torch.randn(32, 32, generator=g) * 2).to(torch.bfloat16)  # lane, 32 activations
    if fmt == "nvfp4":
        sc = (torch.rand(32, 2, 4, generator=g) * 7 + 0.01).to(torch.float8_e4m3fn).view(torch.uint8)
        sc[0, 0, 2 * sub] = 0  # a zero scale and an e4m3 subnormal
        sc[1, 1, 2 * sub + 1] = 3
    else:
        sc = torch.randint(118, 136, (32, 2, 4), generator=g, dtype=torch.uint8)
        sc[0, 0, sub] = 0  # E8M0 0 -> 2**-127
    unit = 2.0**-63 if fmt == "nvfp4" else 1.0  # the NVFP4 asm works in units of 2**-63 (fold)
    cin = torch.randn(32, 8, generator=g).double()
    ops = []
    for lane in range(32):
        o = [0] * 8
        o += [_f32_bits(v * unit) for v in cin[lane].tolist()]
        o += [int(w) for w in words[lane, 0]] + [int(w) for w in words[lane, 1]]
        xw = xs[lane].view(torch.int16).to(torch.int64) & 0xFFFF
        o += [int(xw[2 * i]) | (int(xw[2 * i + 1]) << 16) for i in range(16)]
        for r in range(2):
            b = [int(v) for v in sc[lane, r]]
            o.append(b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24)
        ops.append(o)
    out = run_warp_ptx(asm, ops)
    # expected: weight value v of lane (g, q), row r -> e2m1 x block scale (asm units)
    codes = torch.stack([(words >> (4 * k)) & 15 for k in range(8)], dim=-1).reshape(32, 2, 32)  # lane,row,value
    vals = fp4.decode_e2m1(codes.to(torch.uint8)).double()
    if fmt == "nvfp4":
        sidx = 2 * sub + torch.arange(32) // 16
        s = fp4.decode_scales(sc, "nvfp4").double()[:, :, sidx]
    else:
        s = fp4.decode_scales(sc, "mxfp4").double()[:, :, [sub]]
    w = vals * s  # [lane, row, value]
    xd = xs.double()
    for lane in range(32):
        grp, q = lane >> 2, lane & 3
        got = [(_f32_val(out[lane][i]) + _f32_val(out[lane][4 + i])) / unit for i in range(4)]
        for i, (row, col) in enumerate(((0, 2 * q), (0, 2 * q + 1), (1, 2 * q), (1, 2 * q + 1))):
            terms = torch.cat([w[4 * grp + qq, row] * xd[4 * col + qq] for qq in range(4)])
            want = cin[lane, i].item() + cin[lane, 4 + i].item() + terms.sum().item()
            # fp32 accumulation: tolerance from the size of the terms (they cancel)
            tol = 1e-6 * (terms.abs().sum().item() + abs(want) + 1)
            assert abs(got[i] - want) <= tol, (fmt, sub, lane, i, got[i], want)
