"""``dsv4_mtp::fp4_moe``: the CPU reference against a dense float64 computation, input validation,
the PTX decode's values (CPU), and the helpers of the GPU kernel tests (``test_fp4_moe_kernels.py``)."""

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
    seed = T  # experts; the inputs use seed + 100
    print(f"seed={seed}")
    W = make_experts(E, D, I, fmt, seed=seed)
    x, ids, rw = make_inputs(T, E, k, D, seed=seed + 100)
    want = dense_f64(x, ids, rw, W, fmt)
    assert want.abs().max() > 0
    # the reference returns x.dtype; fp32 activations keep its own (fp32) rounding visible
    got = fp4_moe_reference(x.float(), ids, rw, *W, fmt, LIMIT)
    assert got.dtype == torch.float32
    assert rel_err(got, want) < 1e-5, f"seed={seed}"
    # through the registered op (CPU dispatch) with bf16 activations
    out = fp4_moe(x, ids, rw, *W, fmt, LIMIT)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert rel_err(out, want) < 1e-2, f"seed={seed}"


def test_clamp_is_exercised():
    E, D, I = 4, 128, 64
    print("seed=3")
    W = make_experts(E, D, I, "nvfp4", seed=3)
    x, ids, rw = make_inputs(16, E, 2, D, seed=4)
    w13, s13, g13 = W[:3]
    a = fp4.dequantize_fp4(w13[0], s13[0], "nvfp4", dtype=torch.float64)
    gate = x.double() @ a[:I].t() * g13[0, 0].double()
    assert 0 < (gate > LIMIT).double().mean() < 0.5, "seed=3"


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

    print("seed=0")
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


def test_decode8_f32_ptx_bits_exact():
    """The stream kernels' PTX decode (one int32 word -> 8 fp32): $0-$3 are the low nibbles of
    bytes 0-3 and $4-$7 the high nibbles, each the fp32 bits of e2m1 x 2**-126 (RAW)."""
    from dsv4_mtp_hf.ops.triton import decode_ptx

    def want_bits(code):
        v = torch.tensor(fp4.E2M1_VALUES[code & 7] * (-1.0 if code & 8 else 1.0), dtype=torch.float64)
        return int((v * 2.0**-126).to(torch.float32).view(torch.int32).item()) & 0xFFFFFFFF

    asm = decode_ptx.DECODE8_F32_RAW
    body = asm[asm.index("prmt"):asm.rindex("}")]
    print("seed=1")
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


def test_package_imports_without_triton_on_cpu():
    import dsv4_mtp_hf.ops as ops

    assert callable(ops.fp4_moe) and callable(ops.register_cuda_kernels)


# ----------------------------------------------------------------------------- GPU helpers
# (the kernel tests: tests/test_fp4_moe_kernels.py)
SHAPES = {"flash": (16, 4096, 2048), "small": (16, 1024, 512)}


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
