"""``dsv4_mtp::argmax``: the op (and its one-launch Triton kernel) is ``torch.argmax(x, -1)``,
ties to the first index, the first NaN winning over everything, -0.0 tying with +0.0."""

import warnings

import pytest
import torch

from dsv4_mtp_hf.ops.argmax import KERNEL_MAX_ROWS, argmax_last, argmax_op, argmax_split

V = 129280  # the V4 vocabulary
SEED = 777


def gen(device="cpu", seed=SEED):
    print(f"seed={seed}")
    return torch.Generator(device=device).manual_seed(seed)


def planted(rows: int, v: int, g: torch.Generator, dtype=torch.float32, device="cpu", shift: int = 0) -> torch.Tensor:
    """Random rows, then per row one hard case (row r: case (r + shift) % 6): ties of the maximum,
    NaNs (with +inf), all -inf, signed zeros, the maximum in the last element, few distinct values."""
    x = torch.randn(rows, v, generator=g, device=device).to(dtype)
    pos = torch.randint(0, v, (rows, 4), generator=g, device=device)
    for r in range(rows):
        case = (r + shift) % 6
        if case == 0:
            x[r, pos[r]] = x[r].max() + 1
        elif case == 1:
            x[r, pos[r, :2]] = float("nan")
            x[r, pos[r, 2:]] = float("inf")
        elif case == 2:
            x[r] = float("-inf")
        elif case == 3:
            x[r] = -x[r].abs()
            x[r, pos[r, :2]] = 0.0
            x[r, pos[r, 2:]] = -0.0
        elif case == 4:
            x[r, -1] = x[r].max() + 1
        else:
            x[r] = torch.randint(-2, 3, (v,), generator=g, device=device).to(dtype)
    return x


# ----------------------------------------------------------------------------- CPU
def test_torch_argmax_semantics_the_op_matches():
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, nan, 3.0, nan, inf], [inf, 2.0, inf, nan, 0.0], [-inf] * 5, [0.0, -0.0, 1.0, 1.0, 0.0],
                      [-0.0, 0.0, -1.0, -1.0, -0.0]])
    assert torch.argmax(x, -1).tolist() == [1, 3, 0, 2, 0]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert argmax_op(x.to(dtype)).tolist() == [1, 3, 0, 2, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_op_and_argmax_last_are_torch_argmax(dtype):
    g = gen()
    for v in (5000, V):
        x = planted(7, v, g, dtype)
        want = torch.argmax(x, -1)
        for t, w in ((x, want), (x.view(7, 1, v), want.view(7, 1)), (x[3], want[3])):
            assert torch.equal(argmax_op(t), w)
            assert torch.equal(argmax_last(t), w)
            assert torch.equal(argmax_split(t), w)


def test_op_schema_fake_and_compile():
    x = planted(4, 4096, gen())
    torch.library.opcheck(argmax_op, (x,))  # schema, fake tensor, AOT dispatch
    fn = torch.compile(lambda t: argmax_op(t * 2.0) + 1, fullgraph=True, backend="aot_eager")
    assert torch.equal(fn(x), torch.argmax(x, -1) + 1)


# ----------------------------------------------------------------------------- GPU
def _kernel():
    from dsv4_mtp_hf.ops.triton import argmax_triton

    return argmax_triton


@pytest.mark.gpu
@pytest.mark.parametrize("rows,dtype", [(1, torch.bfloat16), (4, torch.float32), (16, torch.float16)])
def test_cuda_kernel_is_torch_argmax(rows, dtype):
    k = _kernel()
    g = gen("cuda")
    for it in range(6):  # every case in every row; each call relies on the previous one resetting its tickets
        x = planted(rows, V, g, dtype, "cuda", shift=it)
        want = torch.argmax(x, -1)
        assert torch.equal(want.cpu(), torch.argmax(x.cpu(), -1))  # CUDA and CPU agree (NaNs, ties)
        assert torch.equal(k.argmax_triton(x), want), f"seed={SEED}"
        assert torch.equal(argmax_op(x), want)  # the registered CUDA kernel
        assert torch.equal(argmax_last(x), want)
        assert torch.equal(argmax_last(x.view(rows, 1, V)), want.view(rows, 1))
        torch.cuda.synchronize()
        assert not k.workspace(x.device)[1].any()


@pytest.mark.gpu
def test_cuda_kernel_odd_shapes_and_fallbacks():
    k = _kernel()
    g = gen("cuda")
    for v in (4096, 5000, 50001, 2**20 + 3):  # V not a multiple of the chunk; long rows: several tiles
        x = planted(6, v, g, torch.bfloat16, "cuda")
        assert torch.equal(k.argmax_triton(x), torch.argmax(x, -1)), (v, f"seed={SEED}")
    x = planted(5, V + 7, g, torch.float32, "cuda")
    sliced = x[:, 7:]  # strided rows
    assert torch.equal(argmax_op(sliced), torch.argmax(sliced, -1))
    many = planted(KERNEL_MAX_ROWS + 3, 8192, g, torch.bfloat16, "cuda")  # beyond the tickets: torch.argmax
    assert torch.equal(argmax_op(many), torch.argmax(many, -1))
    assert torch.equal(argmax_last(many), torch.argmax(many, -1))
    small = planted(3, 300, g, torch.bfloat16, "cuda")
    assert torch.equal(argmax_op(small), torch.argmax(small, -1))
    assert not k.workspace(x.device)[1].any()


@pytest.mark.gpu
def test_cuda_graph_replay_and_torch_compile():
    k = _kernel()
    g = gen("cuda")
    static = planted(4, V, g, torch.bfloat16, "cuda")

    def step(t):  # a tail like the draft step's: logits in, argmax of each row out
        return argmax_last(t * 1.0).unsqueeze(-1)

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(static), compiled(static)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(compiled(static).squeeze(-1), torch.argmax(static, -1))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_eager = step(static)
        out_compiled = compiled(static)
        out_again = argmax_op(static)  # two launches in one graph: the tickets reset in between
    for it in range(4):
        static.copy_(planted(4, V, g, torch.bfloat16, "cuda", shift=it))
        graph.replay()
        want = torch.argmax(static, -1)
        assert torch.equal(out_eager.squeeze(-1), want)
        assert torch.equal(out_compiled.squeeze(-1), want)
        assert torch.equal(out_again, want), f"seed={SEED}"
    torch.cuda.synchronize()
    assert not k.workspace(static.device)[1].any()


@pytest.mark.gpu
def test_first_call_inside_a_capture_falls_back(monkeypatch):
    from dsv4_mtp_hf.ops.triton import persistent

    _kernel()
    monkeypatch.setattr(persistent, "_BUFFERS", {})  # no workspace yet on any device
    x = planted(2, V, gen("cuda"), torch.bfloat16, "cuda")
    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.cuda.graph(graph):
            out = argmax_op(x)
    assert any("capture" in str(c.message) for c in caught)
    assert not persistent._BUFFERS  # nothing allocated inside the capture
    graph.replay()
    assert torch.equal(out, torch.argmax(x, -1))
