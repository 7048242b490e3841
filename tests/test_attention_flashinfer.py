"""The FlashInfer attention backend: selection, window metadata, sink correction, graphs.

CPU tests run the whole backend -- plans, per-step wrappers, window metadata, sink
correction, the drafter's re-planning -- against a stand-in for FlashInfer's MLA wrapper
that does what its documentation says the kernel does (page lists of ``page_size=1``, base-2
LSE, fixed buffers in graph mode).  The GPU tests run FlashInfer itself.
"""

import math
import sys
import types

import pytest
import torch

from dsv4_mtp_hf.ops import attention_flashinfer as fi
from dsv4_mtp_hf.ops.attention import sliding_window_attention_reference

from .helpers import randomize_, tiny_pair

# -- a CPU stand-in for flashinfer.mla -------------------------------------------------------------


class _FakeMLAWrapper:
    """``BatchMLAPagedAttentionWrapper`` semantics for ``head_dim_kpe=0, page_size=1``: request r
    attends its query rows to ``kv_cache[kv_indices[kv_indptr[r] : kv_indptr[r] + kv_len[r]], 0]``.
    In graph mode plan() copies into the caller's buffers and run() reads only those."""

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
                 kv_indices=None, kv_len_arr=None, backend="auto"):
        self.graph, self.buffers = use_cuda_graph, (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        self.plans = 0

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type,
             kv_data_type, lse_mode):
        assert (head_dim_kpe, page_size, causal, lse_mode) == (0, 1, False, "base2")
        src = (metadata.qo_indptr, metadata.kv_indptr, metadata.kv_indices, metadata.kv_len_arr)
        assert all(t.dtype == torch.int32 for t in src)
        if self.graph:
            for buf, t in zip(self.buffers, src):
                assert buf.shape[0] >= t.shape[0]
                buf[: t.shape[0]].copy_(t)
        else:
            self.buffers = tuple(t.clone() for t in src)
        self.num_heads, self.sm_scale, self.plans = num_heads, sm_scale, self.plans + 1

    def run(self, *, query, kv_cache, return_lse, out=None, lse=None):
        qo_indptr, kv_indptr, kv_indices, kv_len = (t.long() for t in self.buffers)
        keys = kv_cache[:, 0].float()
        out = torch.empty_like(query) if out is None else out
        lse = torch.empty(query.shape[:2]) if lse is None else lse
        for r in range(kv_len.shape[0]):
            k = keys[kv_indices[kv_indptr[r] : kv_indptr[r] + kv_len[r]]]
            q = query[qo_indptr[r] : qo_indptr[r + 1]].float()
            scores = torch.einsum("shd,ld->shl", q, k) * self.sm_scale
            out[qo_indptr[r] : qo_indptr[r + 1]] = (scores.softmax(-1) @ k).to(query.dtype)
            lse[qo_indptr[r] : qo_indptr[r + 1]] = scores.logsumexp(-1) / math.log(2.0)
        return out, lse


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """FlashInfer 'installed' as the stand-in, and allowed on CPU in fp32."""
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = _FakeMLAWrapper
    mla.MLAPlanMetadata = types.SimpleNamespace(
        csr=lambda q, k, i, n: types.SimpleNamespace(qo_indptr=q, kv_indptr=k, kv_indices=i, kv_len_arr=n))
    utils = types.ModuleType("flashinfer.utils")
    utils.is_sm90a_supported = lambda device: False
    pkg = types.ModuleType("flashinfer")
    pkg.mla, pkg.utils = mla, utils
    for name, mod in (("flashinfer", pkg), ("flashinfer.mla", mla), ("flashinfer.utils", utils)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(fi, "_import_error", None)
    monkeypatch.setattr(fi, "_supported", lambda dtype, device, head_dim, rows, paged_cache, grad: paged_cache)
    return mla


def paged_layout(first_positions, s, window, d, gen, dtype=torch.float32):
    """kv ``[B, W-1+S, d]`` and positions as :meth:`PagedMtpKVCache.update` returns them."""
    p0 = torch.tensor(first_positions).unsqueeze(1)
    pos = p0 - (window - 1) + torch.arange(window - 1 + s)
    pos = torch.where(pos >= 0, pos, torch.full_like(pos, -(1 << 40)))
    kv = torch.randn(len(first_positions), window - 1 + s, d, generator=gen).to(dtype)
    return kv, pos, p0 + torch.arange(s)


def random_case(first_positions, s, heads, d, window, sinks_on, gen, dtype=torch.float32):
    kv, kv_pos, q_pos = paged_layout(first_positions, s, window, d, gen, dtype)
    q = torch.randn(len(first_positions), s, heads, d, generator=gen).to(dtype)
    sinks = 2 * torch.randn(heads, generator=gen) if sinks_on else torch.full((heads,), float("-inf"))
    return q, kv, kv_pos, q_pos, sinks


# -- CPU: selection and errors -------------------------------------------------------------------------


def test_auto_picks_the_reference_on_cpu_without_importing_flashinfer(monkeypatch):
    monkeypatch.setattr(fi, "_import_error", None)
    assert fi.select_attention_backend("auto", torch.float32, torch.device("cpu"), 512, 1, True) == "reference"
    assert fi._import_error is None  # the cheap checks failed first: no import attempted
    assert fi.select_attention_backend("reference", torch.bfloat16, torch.device("cuda"), 512, 1, True) == "reference"
    with pytest.raises(ValueError, match="'auto', 'reference' or 'flashinfer'"):
        fi.select_attention_backend("flash", torch.bfloat16, torch.device("cuda"), 512, 1, True)


def test_explicit_flashinfer_names_every_problem_and_its_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # not installed
    monkeypatch.setattr(fi, "_import_error", None)
    with pytest.raises(RuntimeError) as err:
        fi.select_attention_backend("flashinfer", torch.float32, torch.device("cpu"), 64, fi.MAX_ROWS + 1, False)
    msg = str(err.value)
    for fix in ("pip install flashinfer-python", "new_cache(paged=True", "CUDA", "torch_dtype=torch.bfloat16",
                "head_dim=64", f"blocks of at most {fi.MAX_ROWS}", "'auto'"):
        assert fix in msg
    # auto never raises: it falls back
    assert fi.select_attention_backend("auto", torch.bfloat16, torch.device("cuda"), 512, 1, True) == "reference"


def test_supported_calls_select_flashinfer_when_importable(monkeypatch):
    monkeypatch.setattr(fi, "_import_error", "")  # importable
    cuda = torch.device("cuda")
    for requested in ("auto", "flashinfer"):
        assert fi.select_attention_backend(requested, torch.bfloat16, cuda, 512, 4, True) == "flashinfer"
    assert fi.select_attention_backend("auto", torch.bfloat16, cuda, 512, 4, False) == "reference"  # contiguous cache
    assert fi.select_attention_backend("auto", torch.float32, cuda, 512, 4, True) == "reference"
    with pytest.raises(RuntimeError, match="bfloat16/float16") as err:
        fi.select_attention_backend("flashinfer", torch.float32, cuda, 512, 4, True)
    assert "not importable" not in str(err.value)
    assert fi.select_attention_backend("auto", torch.bfloat16, cuda, 512, 4, True, needs_grad=True) == "reference"
    with pytest.raises(RuntimeError, match="no backward"):
        fi.select_attention_backend("flashinfer", torch.bfloat16, cuda, 512, 4, True, needs_grad=True)


def test_model_with_explicit_flashinfer_raises_on_cpu_instead_of_falling_back(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setattr(fi, "_import_error", None)
    _, mtp = tiny_pair(attention_backend="flashinfer")
    ids, hs = torch.randint(0, 320, (1, 3)), torch.randn(1, 3, mtp.config.hc_mult, mtp.config.hidden_size)
    with torch.no_grad(), pytest.raises(RuntimeError, match="pip install flashinfer-python"):
        mtp(ids, hs, past_key_values=mtp.new_cache(paged=True))
    from dsv4_mtp_hf.generation.mtp_graph import GraphedDrafter

    with pytest.raises(RuntimeError, match="attention_backend='flashinfer'"):
        GraphedDrafter(mtp, mtp.new_cache(paged=True), num_drafts=3)
    mtp.config.attention_backend = "auto"  # read per call: now the reference runs
    with torch.no_grad():
        mtp(ids, hs, past_key_values=mtp.new_cache(paged=True))


# -- CPU: the backend's logic on the stand-in kernel ---------------------------------------------------


def test_window_metadata_lists_each_rows_window_newest_first():
    qo, kv_indptr, kv_indices, lens = fi.window_metadata([2, 40], num_keys=7 + 2, num_queries=2, window=8)
    assert qo.tolist() == [0, 1, 2, 3, 4] and lens.tolist() == [3, 4, 8, 8]
    assert kv_indptr.tolist() == [0, 3, 7, 15, 23]
    own = [7, 8, 9 + 7, 9 + 8]  # flattened slots of each row's own key
    want = [list(range(o, o - n, -1)) for o, n in zip(own, lens.tolist())]
    assert kv_indices.tolist() == sum(want, [])


@pytest.mark.parametrize("batch,s", [(1, 1), (4, 1), (4, 3)])
@pytest.mark.parametrize("sinks_on", [True, False])
def test_stand_in_kernel_with_window_metadata_equals_the_reference(fake_flashinfer, batch, s, sinks_on):
    gen = torch.Generator().manual_seed(batch * 10 + s)
    window, heads, d = 8, 4, 32
    first = [0, 3, 7, 30][:batch]  # ragged: shorter and longer than the window
    q, kv, kv_pos, q_pos, sinks = random_case(first, s, heads, d, window, sinks_on, gen)
    plans = fi.FlashInferWindowPlans(heads, d, window, d**-0.5, torch.float32, "cpu")
    got = fi.sliding_window_attention_flashinfer(q, kv, torch.tensor(first), sinks, plans)
    want = sliding_window_attention_reference(q, kv, q_pos, kv_pos, sinks, window, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_plans_are_reused_once_every_sequence_is_a_window_long(fake_flashinfer):
    plans = fi.FlashInferWindowPlans(4, 32, 8, 0.1, torch.float32, "cpu", steps=2, rows=2)
    plans.plan_decode_steps([3, 9])
    assert [slot.wrapper.plans for slot in plans.steps] == [1, 1]
    plans.plan_decode_steps([3, 9])  # same positions: nothing to do
    plans.plan_decode_steps([7, 20])  # step 0 at positions 7, 20: both full windows; so is step 1
    plans.plan_decode_steps([100, 12])  # still full windows everywhere: the same plans
    assert [slot.wrapper.plans for slot in plans.steps] == [2, 2]
    assert plans.steps[0].key == plans.steps[1].key == (2, 8, 1)


def test_model_on_the_stand_in_equals_the_reference_with_ragged_lengths(fake_flashinfer):
    _, mtp = tiny_pair(max_draft_tokens=4)
    gen = torch.Generator().manual_seed(3)
    b, v = 3, mtp.config.vocab_size
    caches = {name: mtp.new_cache(paged=True, batch_size=b) for name in ("flashinfer", "reference")}
    with torch.no_grad():
        for step in range(12):
            s = 5 if step == 0 else 1 + step % 3
            ids = torch.randint(0, v, (b, s), generator=gen)
            hs = torch.randn(b, s, mtp.config.hc_mult, mtp.config.hidden_size, generator=gen)
            out = {}
            for name, cache in caches.items():
                mtp.config.attention_backend = name
                out[name] = mtp(ids, hs, past_key_values=cache).logits
                if step:  # each sequence keeps a different number of rows
                    cache.truncate(cache.seq_lengths - s + torch.tensor([s, 1, (step % s) + 1]))
            torch.testing.assert_close(out["flashinfer"], out["reference"], rtol=1e-5, atol=1e-5)
    assert min(caches["flashinfer"].seq_lengths.tolist()) >= 2 * mtp.config.sliding_window  # short, then long contexts


def test_drafter_replans_steps_and_a_replayed_plan_is_exact(fake_flashinfer, monkeypatch):
    """What a replay runs: each step's wrapper as planned before it, never re-planned inside.
    Simulated on CPU by marking the stream as capturing while the steps run."""
    from dsv4_mtp_hf.generation.mtp_graph import GraphedDrafter

    _, mtp = tiny_pair(max_draft_tokens=4)
    gen = torch.Generator().manual_seed(4)
    b, w = 2, mtp.config.sliding_window
    ids = torch.randint(0, mtp.config.vocab_size, (b, 12), generator=gen)
    hs = torch.randn(b, 12, mtp.config.hc_mult, mtp.config.hidden_size, generator=gen)
    paged = mtp.new_cache(paged=True, batch_size=b)
    mtp.config.attention_backend = "flashinfer"
    drafter = GraphedDrafter(mtp, paged, num_drafts=4)
    assert not hasattr(paged, "attention_plans") and len(drafter.attention_plans.steps) == 3  # the drafter's
    ref_cache = mtp.new_cache(paged=True, batch_size=b)
    with torch.no_grad():
        mtp(ids, hs, past_key_values=paged)
        mtp(ids, hs, past_key_values=ref_cache)
        drafter.tokens.copy_(ids[:, -1:])
        drafter.residual.copy_(hs[:, -1:])
        for lengths in ([2, 5], [12, 3], [w + 2, w - 2]):  # each replay from other lengths, short and long
            paged.seq_lengths.copy_(torch.tensor(lengths))  # keys below these lengths stay as written
            ref_cache.seq_lengths.copy_(torch.tensor(lengths))
            drafter._plan_attention(lengths)  # what __call__(..., seq_lengths=lengths) does before replaying
            planned = [slot.wrapper.plans for slot in drafter.attention_plans.steps]
            monkeypatch.setattr(fi, "_capturing", lambda: True)
            drafts, logits = drafter.run_eager()  # as captured: the planned wrappers as they are
            monkeypatch.setattr(fi, "_capturing", lambda: False)
            assert [slot.wrapper.plans for slot in drafter.attention_plans.steps] == planned
            assert paged.seq_lengths.tolist() == [n + 3 for n in lengths]
            mtp.config.attention_backend = "reference"
            tok, res = ids[:, -1:], hs[:, -1:]
            for k in range(3):  # the reference, fed the drafter's own tokens
                out = mtp(tok, res, past_key_values=ref_cache)
                torch.testing.assert_close(logits[:, k], out.logits[:, -1], rtol=1e-5, atol=1e-5)
                tok, res = drafts[:, k : k + 1], out.residual
            mtp.config.attention_backend = "flashinfer"
    keys = [slot.key for slot in drafter.attention_plans.steps]
    paged.seq_lengths.copy_(torch.tensor([3, 4]))
    drafter._plan_attention()  # without host lengths: read from the device
    assert [slot.key for slot in drafter.attention_plans.steps] != keys
    assert drafter.attention_plans.steps[0].key == ((3, 4), w, 1)
    # a step wrapper left unplanned cannot be captured
    fresh = fi.FlashInferWindowPlans(4, 32, w, 0.1, torch.float32, "cpu", steps=1, rows=b)
    fresh.rewind()
    monkeypatch.setattr(fi, "_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="outside CUDA-graph capture"):
        fresh.run(torch.randn(b, 1, 4, 32), torch.randn(b, w, 32), torch.tensor([5, 6]))


def test_drafter_under_auto_keeps_the_reference_attention(fake_flashinfer):
    """'auto' leaves a drafter's steps on the reference attention (compiled and captured as before);
    eager forwards on other paged caches still take FlashInfer."""
    from dsv4_mtp_hf.generation.mtp_graph import GraphedDrafter

    _, mtp = tiny_pair(max_draft_tokens=4)
    assert mtp.config.attention_backend == "auto"
    drafter = GraphedDrafter(mtp, mtp.new_cache(paged=True, batch_size=2), num_drafts=3)
    assert drafter.attention_plans is None and drafter.attention_backend == "reference"
    attn, q = mtp.block.self_attn, torch.zeros(1)
    assert attn.attention_backend(q.dtype, q.device, 2, drafter.cache, requested=drafter.attention_backend) == "reference"
    assert attn.attention_backend(q.dtype, q.device, 2, mtp.new_cache(paged=True, batch_size=2)) == "flashinfer"
    mtp.config.attention_backend = "flashinfer"  # named: the drafter plans FlashInfer steps
    drafter = GraphedDrafter(mtp, mtp.new_cache(paged=True, batch_size=2), num_drafts=3)
    assert drafter.attention_backend is None and len(drafter.attention_plans.steps) == 2


# -- GPU: FlashInfer itself -----------------------------------------------------------------------------
SEED = 5150


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.gpu
@pytest.mark.parametrize("batch,s,sinks_on", [(1, 1, True), (4, 3, False)])
def test_flashinfer_equals_the_reference_on_random_windows(batch, s, sinks_on):
    print(f"seed={SEED}")
    gen = torch.Generator().manual_seed(SEED)
    window, heads, d = 128, 64, 512
    first = [5, 127, 60, 1000][:batch]  # ragged: shorter and longer than the window
    q, kv, kv_pos, q_pos, sinks = (t.cuda() for t in random_case(first, s, heads, d, window, sinks_on, gen,
                                                                    torch.bfloat16))
    plans = fi.FlashInferWindowPlans(heads, d, window, d**-0.5, torch.bfloat16, "cuda")
    got = fi.sliding_window_attention_flashinfer(q, kv, torch.tensor(first, device="cuda"), sinks, plans)
    want = sliding_window_attention_reference(q.double(), kv.double(), q_pos, kv_pos, sinks.double(), window,
                                              d**-0.5)
    assert _rel(got, want) < 1e-2


@pytest.mark.gpu
def test_flashinfer_graph_replays_after_replanning_equal_the_reference():
    print(f"seed={SEED}")
    gen = torch.Generator().manual_seed(SEED)
    b, window, heads, d = 3, 128, 64, 512
    plans = fi.FlashInferWindowPlans(heads, d, window, d**-0.5, torch.bfloat16, "cuda", steps=1, rows=b)
    q = torch.randn(b, 1, heads, d, generator=gen).to(torch.bfloat16).cuda()
    kv = torch.randn(b, window, d, generator=gen).to(torch.bfloat16).cuda()
    sinks = (2 * torch.randn(heads, generator=gen)).cuda()
    first = torch.zeros(b, dtype=torch.long, device="cuda")
    plans.plan_decode_steps([3, 50, 200])
    for _ in range(2):  # warm-up outside the capture
        plans.rewind()
        fi.sliding_window_attention_flashinfer(q, kv, first, sinks, plans)
    plans.plan_decode_steps([3, 50, 200])
    graph = torch.cuda.CUDAGraph()
    plans.rewind()
    with torch.cuda.graph(graph):
        out = fi.sliding_window_attention_flashinfer(q, kv, first, sinks, plans)
    for lengths in ([3, 50, 200], [0, 127, 126], [90, 1, 4000]):
        q.copy_(torch.randn(q.shape, generator=gen).to(torch.bfloat16))
        kv.copy_(torch.randn(kv.shape, generator=gen).to(torch.bfloat16))
        plans.plan_decode_steps(lengths)
        graph.replay()
        _, kv_pos, q_pos = paged_layout(lengths, 1, window, d, gen)
        want = sliding_window_attention_reference(q.double(), kv.double(), q_pos.cuda(), kv_pos.cuda(),
                                                  sinks.double(), window, d**-0.5)
        assert _rel(out, want) < 1e-2, lengths


def _bf16_mtp(**mtp_overrides):
    """A tiny pair with 512-dim heads in bf16 (weights loaded as a user would: fp32 norms kept).

    Weights at std 0.02 and a fixed expert choice: a random model at std 0.2 amplifies the
    attention's bf16 rounding (~3e-3, the same for any correct kernel) about 4x by the logits,
    and ties in the routing turn it into whole-token jumps; neither says anything about the
    attention backend."""
    target, mtp = tiny_pair(
        max_draft_tokens=4, target_overrides=dict(hidden_size=256, moe_intermediate_size=256, num_attention_heads=16,
                                                  head_dim=512, partial_rotary_factor=0.125, sliding_window=16),
        **mtp_overrides)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        randomize_(mtp, gen, std=0.02)
        mtp.block.self_attn.sinks.copy_(torch.randn(mtp.config.num_attention_heads, generator=gen))
        bias = mtp.block.mlp.gate.e_score_correction_bias
        bias.copy_(100.0 * torch.arange(bias.numel(), 0, -1))
    for name, prm in mtp.named_parameters():
        if prm.dtype == torch.float32 and not any(k in name for k in mtp._keep_in_fp32_modules_strict):
            prm.data = prm.data.to(torch.bfloat16)
    return target.cuda(), mtp.cuda()


@pytest.mark.gpu
def test_mtp_draft_logits_flashinfer_vs_reference():
    _, mtp = _bf16_mtp()
    print(f"seed={SEED}")
    gen = torch.Generator().manual_seed(SEED)
    b, v, c = 4, mtp.config.vocab_size, mtp.config
    caches = {name: mtp.new_cache(paged=True, batch_size=b) for name in ("flashinfer", "reference")}
    rel, same, total = [], 0, 0
    with torch.no_grad():
        for step in range(100):
            s = 20 if step == 0 else 1
            ids = torch.randint(0, v, (b, s), generator=gen).cuda()
            hs = torch.randn(b, s, c.hc_mult, c.hidden_size, generator=gen).to(torch.bfloat16).cuda()
            out = {}
            for name, cache in caches.items():
                mtp.config.attention_backend = name
                out[name] = mtp(ids, hs, past_key_values=cache).logits.float()
                if step == 0:  # ragged: two sequences shorter than the window, two longer
                    cache.truncate(torch.tensor([3, 20, 9, 17], device="cuda"))
            rel.append(_rel(out["flashinfer"], out["reference"]))
            same += int((out["flashinfer"].argmax(-1) == out["reference"].argmax(-1)).sum())
            total += out["reference"][..., 0].numel()
    assert max(rel) < 1e-2, max(rel)
    assert same / total >= 0.99, (same, total)


@pytest.mark.gpu
def test_graphed_drafter_with_flashinfer_replays_its_eager_run_and_the_reference():
    from dsv4_mtp_hf.generation.mtp_graph import GraphedDrafter

    _, mtp = _bf16_mtp(attention_backend="flashinfer")
    print(f"seed={SEED}")
    gen = torch.Generator().manual_seed(SEED)
    b, c = 4, mtp.config
    ids = torch.randint(0, c.vocab_size, (b, 30), generator=gen).cuda()
    hs = torch.randn(b, 30, c.hc_mult, c.hidden_size, generator=gen).to(torch.bfloat16).cuda()
    paged = mtp.new_cache(paged=True, batch_size=b)
    with torch.no_grad():
        mtp(ids[:, :-1], hs[:, :-1], past_key_values=paged)
        paged.truncate(torch.tensor([2, 9, 14, 29], device="cuda"))
    drafter = GraphedDrafter(mtp, paged, num_drafts=4)
    drafter.tokens.copy_(ids[:, -1:])
    drafter.residual.copy_(hs[:, -1:])
    drafter.capture()
    for lengths in ([2, 9, 14, 29], [5, 1, 29, 12], [29, 29, 0, 16]):  # re-planned before each replay
        start = torch.tensor(lengths, device="cuda")  # keys below these lengths stay as written
        paged.seq_lengths.copy_(start)
        got_d, got_l = (t.clone() for t in drafter(ids[:, -1:], hs[:, -1:]))
        paged.seq_lengths.copy_(start)
        want_d, want_l = drafter.run_eager()
        torch.testing.assert_close(got_l, want_l, rtol=1e-3, atol=1e-3)
        assert torch.equal(got_d, want_d)
        paged.seq_lengths.copy_(start)  # the reference attention, fed the graph's own drafts
        mtp.config.attention_backend = "reference"
        tok, res = ids[:, -1:], hs[:, -1:]
        with torch.no_grad():
            for k in range(3):
                out = mtp(tok, res, past_key_values=paged)
                assert _rel(got_l[:, k], out.logits[:, -1]) < 1e-2
                tok, res = got_d[:, k : k + 1], out.residual
        mtp.config.attention_backend = "flashinfer"

