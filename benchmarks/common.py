"""What the benchmarks share: random V4-Flash-shaped targets and drafters, timing, reference switches.

Each benchmark is a script run from the repository root; they import this module (beside them), never each
other.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from dsv4_mtp_hf import DeepseekV4MtpConfig, DeepseekV4MtpForCausalLM
from dsv4_mtp_hf.ops import fp4_moe_reference


def target_config(tiny: bool) -> DeepseekV4Config:
    kw = dict(num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"])
    if tiny:
        kw.update(vocab_size=1024, hidden_size=256, moe_intermediate_size=256, num_attention_heads=4, head_dim=64,
                  q_lora_rank=64, o_groups=2, o_lora_rank=32, n_routed_experts=16, sliding_window=16,
                  index_n_heads=8, index_head_dim=32, partial_rotary_factor=0.25)
    return DeepseekV4Config(**kw)


@torch.no_grad()
def fill_random_(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Random, well-scaled values for every tensor (fresh each run, never zeros)."""
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if "inv_freq" in name:
            continue
        if t.dtype == torch.uint8:
            if name.endswith("_scale"):  # e8m0 bytes near 2**-7: FP4 values up to ~0.05
                t.copy_(torch.randint(118, 123, t.shape, generator=gen, device=t.device, dtype=torch.uint8))
            else:
                t.copy_(torch.randint(0, 256, t.shape, generator=gen, device=t.device, dtype=torch.uint8))
        elif t.dtype == torch.int32:  # global scale bit patterns
            t.copy_(torch.ones(t.shape, device=t.device).view(torch.int32))
        elif t.is_floating_point():
            if name.endswith("tid2eid"):
                continue
            mean, std = (1.0, 0.05) if "norm" in name or name.endswith(".scale") or name.endswith("hc_scale") else (0.0, 0.02)
            # in place, a slice at a time: a V4-Flash layer's bf16 experts would need 17 GB of fp32 temporaries
            for piece in t.view(-1).split(1 << 26):
                piece.normal_(mean, std, generator=gen)


def init_rotary_(target, config) -> None:
    """Every RoPE table of the target -- the model's, and each compressor's and indexer's -- computed from the
    config: ``to_empty`` leaves their buffers uninitialised and :func:`fill_random_` skips them (garbage
    frequencies made a tiny run's logits NaN now and then)."""
    rope = type(target.model.rotary_emb)
    for module in target.modules():
        if isinstance(module, rope):
            device = next(module.buffers()).device
            module.__init__(config)
            module.to(device)


def init_hash_routers_(target, config, gen: torch.Generator) -> None:
    """Each hash-routed layer's fixed token -> experts table: distinct random experts per token."""
    for layer in target.model.layers:
        router = layer.mlp.gate
        if hasattr(router, "tid2eid"):
            e, k = config.n_routed_experts, config.num_experts_per_tok
            router.tid2eid.copy_(torch.rand(config.vocab_size, e, generator=gen).argsort(-1)[:, :k])


def random_drafter(model_cls, config, device, gen: torch.Generator):
    """A drafter built on ``device`` with random weights: bf16 but for the modules it keeps in fp32."""
    with torch.device("meta"):
        drafter = model_cls(config)
    drafter = drafter.to_empty(device=device).eval()
    fill_random_(drafter, torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen))))
    for name, prm in drafter.named_parameters():
        if prm.dtype == torch.float32 and not any(k in name for k in drafter._keep_in_fp32_modules_strict):
            prm.data = prm.data.to(torch.bfloat16)
    return drafter


def random_pair(tiny: bool, dev: torch.device, gen: torch.Generator, experts: int | None = None):
    """A V4(-Flash)-shaped bf16 target and its bound MTP (reference attention), random weights
    drawn from ``gen``; the MTP's dense weights in bf16 as a user would load them.  ``experts``:
    another routed-expert count (e.g. fewer, to fit a CPU's memory)."""
    tc = target_config(tiny)
    if experts is not None:
        tc.n_routed_experts = experts
    with torch.device("meta"):
        target = DeepseekV4ForCausalLM(tc).to(torch.bfloat16)
        mtp = DeepseekV4MtpForCausalLM(DeepseekV4MtpConfig.from_target_config(tc, attention_backend="reference"))
    target = target.to_empty(device=dev).eval()
    mtp = mtp.to_empty(device=dev).eval()
    for m in (target, mtp):
        fill_random_(m, gen)
    for name, prm in mtp.named_parameters():
        if prm.dtype == torch.float32 and not any(k in name for k in mtp._keep_in_fp32_modules_strict):
            prm.data = prm.data.to(torch.bfloat16)
    init_rotary_(target, tc)
    mtp.bind(target)
    return target, mtp


def prefilled_paged_cache(mtp, bsz: int, context: int, gen: torch.Generator):
    """A paged MTP cache holding ``context`` random rows per sequence, the random ids and
    residuals (one row more, for the draft step) and the cache's lengths."""
    c, dev = mtp.config, mtp.e_proj.weight.device
    paged = mtp.new_cache(paged=True, batch_size=bsz)
    pids = torch.randint(0, c.vocab_size, (bsz, context + 1), device=dev)
    phs = torch.randn(bsz, context + 1, c.hc_mult, c.hidden_size, device=dev, generator=gen, dtype=torch.bfloat16)
    mtp(pids[:, :-1], phs[:, :-1], past_key_values=paged)
    return paged, pids, phs, paged.seq_lengths.clone()


def time_ms(fn, iters: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def time_back_to_back(fn, iters: int, n: int = 20) -> float:
    """Median ms per call of ``n`` calls queued back to back (one event pair around them): the
    GPU time of a graphed step once the host is ahead, without the host's launch latency that
    :func:`time_ms` (one call, then a synchronisation) includes."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(3, iters // 5)):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / n)
    return statistics.median(times)


def copy_bandwidth() -> float:
    x = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), 20)
    return 2 * x.numel() * 4 / (ms * 1e-3)


def build_split_target(layers: int, tiny: bool, gen: torch.Generator, dtype: torch.dtype = torch.bfloat16,
                       packed_experts: bool = False, fp8_linears: bool = False, experts: int | None = None):
    """A random V4-Flash-shaped target (``layers`` decoder layers over the visible GPUs) and its bound MTP.
    ``packed_experts``: the routed experts random MXFP4 from the start (``DeepseekV4PackedExpertsForCausalLM``,
    as ``from_pretrained`` of a release builds it), never allocated in bf16: 5 layers fit an 80 GB GPU.
    ``fp8_linears``: the projections a release stores in FP8 kept so (``quantize_fp8_linears``).
    ``experts``: routed experts per layer (V4-Flash: 256).  At batch 1 a token reads its top-6 whatever the
    total, so fewer experts keep a step's bytes while 43 layers fit one GPU (depth-faithful); a verify of
    several rows overlaps more with fewer experts (:func:`distinct_experts`)."""
    from accelerate import dispatch_model

    from dsv4_mtp_hf import DeepseekV4PackedExpertsForCausalLM

    types = (["heavily_compressed_attention", "compressed_sparse_attention"] * layers)[:layers]
    kw = dict(num_hidden_layers=layers, layer_types=types, mlp_layer_types=["hash_moe"] + ["moe"] * (layers - 1))
    if tiny:
        kw.update(vocab_size=1024, hidden_size=256, moe_intermediate_size=256, num_attention_heads=4, head_dim=64,
                  q_lora_rank=64, o_groups=2, o_lora_rank=32, n_routed_experts=16, sliding_window=16,
                  index_n_heads=8, index_head_dim=32, partial_rotary_factor=0.25,
                  compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16})
    if experts is not None:
        kw["n_routed_experts"] = experts
    tc = DeepseekV4Config(**kw)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # bf16 weights; modules transformers keeps in fp32 stay fp32
    try:
        with torch.device("meta"):
            target = (DeepseekV4PackedExpertsForCausalLM if packed_experts else DeepseekV4ForCausalLM)(tc)
    finally:
        torch.set_default_dtype(default)
    n = max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1
    dev = (lambda i: f"cuda:{i}") if torch.cuda.is_available() else (lambda i: "cpu")
    device_map = {"model.embed_tokens": dev(0), "model.rotary_emb": dev(0)}
    for i in range(layers):
        device_map[f"model.layers.{i}"] = dev(min(n - 1, i * n // layers))
    device_map.update({"model.hc_head": dev(n - 1), "model.norm": dev(n - 1), "lm_head": dev(n - 1)})
    for name, d in device_map.items():
        module = target.get_submodule(name)
        module.to_empty(device=d)
        g = torch.Generator(device=d).manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
        fill_random_(module, g)
    init_hash_routers_(target, tc, gen)
    init_rotary_(target, tc)
    target = dispatch_model(target, device_map=device_map) if torch.cuda.is_available() else target
    target.eval()
    if fp8_linears:
        from dsv4_mtp_hf.target_runtime import quantize_fp8_linears

        quantize_fp8_linears(target)
    mtp = random_drafter(DeepseekV4MtpForCausalLM, DeepseekV4MtpConfig.from_target_config(tc),
                         target.lm_head.weight.device, gen)
    mtp.bind(target)
    return target, mtp, device_map


def distinct_experts(total: int, top_k: int, rows: int) -> float:
    """Expected distinct experts a forward of ``rows`` tokens reads per layer (uniform random routing)."""
    return total * (1 - (1 - top_k / total) ** rows)


def target_step_bytes(target, rows: int = 1) -> float:
    """Bytes a forward of ``rows`` tokens reads: every parameter and buffer once (the embedding: its rows), the
    routed experts the rows touch (:func:`distinct_experts` per layer).  The byte floor of a step is this at copy
    bandwidth: an estimate from the model's own tensors, not a measurement."""
    from dsv4_mtp_hf.target_runtime.experts import expert_bytes

    c = target.config
    embed = target.get_input_embeddings().weight
    every = sum(t.numel() * t.element_size() for t in list(target.parameters()) + list(target.buffers()))
    routed = expert_bytes(target)
    dense = every - routed - embed.numel() * embed.element_size() + rows * embed.shape[1] * embed.element_size()
    per_layer = routed / c.num_hidden_layers
    return dense + c.num_hidden_layers * per_layer * distinct_experts(c.n_routed_experts, c.num_experts_per_tok,
                                                                       rows) / c.n_routed_experts


def sync():
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def wall(fn, repeats: int) -> float:
    """Median wall-clock seconds of `fn()` over `repeats` runs (after one warm-up run)."""
    fn()
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def left_pad(prompts, pad: int, device):
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.numel():], mask[i, width - p.numel():] = p, 1
    return ids.to(device), mask.to(device)


def graphed_us(fn, calls: int, iters: int) -> float:
    """Median µs per call: a CUDA graph of ``calls`` calls back to back, events around each replay."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record(); g.replay(); b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev) * 1e3 / calls


# -- reference switches: the oracle paths the checks and diagnostics compare against --------------------
@contextlib.contextmanager
def hand_written_kernels(on: bool):
    """``on=False``: the PyTorch mHC math and router (not the FP4 MoE / Sinkhorn ops) for the duration --
    the oracle the checks compare against (the package has no switch: this patches the call sites)."""
    import importlib

    if on:
        yield
        return
    hc = importlib.import_module("dsv4_mtp_hf.ops.hyper_connection")
    layers_moe = importlib.import_module("dsv4_mtp_hf.layers.moe")
    route = importlib.import_module("dsv4_mtp_hf.ops.moe_route")
    saved = hc._use_op, layers_moe.moe_route
    hc._use_op, layers_moe.moe_route = (lambda *a: False), route.moe_route_reference
    try:
        yield
    finally:
        hc._use_op, layers_moe.moe_route = saved


@contextlib.contextmanager
def reference_experts(mtp):
    """The routed experts through ``fp4_moe_reference`` (dequantise + fp32 matmuls) instead of
    the registered op, for the duration of the block."""
    ex = mtp.block.mlp.experts

    def reference_moe(x, weights, ids_):
        return fp4_moe_reference(x, ids_, weights.float(), ex.w13_weight, ex.w13_scale, ex.w13_global,
                                 ex.w2_weight, ex.w2_scale, ex.w2_global, ex.format.name, ex.swiglu_limit)

    # An instance-level forward, as accelerate's hooks set: the MoE layer then calls the module
    # (not ``dsv4_mtp::mtp_moe``), so the reference math really runs.
    ex.forward = reference_moe
    try:
        yield
    finally:
        del ex.forward


@contextlib.contextmanager
def fp32_reference(mtp):
    """The reference path with fp32 activations: every bf16 weight of the MTP and of the
    shared embedding / lm head upcast (copies; the same values), the reference MoE math
    (``fp4_moe_reference``, fp32), no fused or skinny kernels.  The "truth" the bf16 paths
    are both roundings of."""
    shared = mtp._shared
    params = {id(t): t for t in [p for _, p in mtp.named_parameters()] + [shared.embed_tokens.weight, shared.lm_head.weight]}
    saved = [(t, t.data) for t in params.values() if t.dtype == torch.bfloat16]
    try:
        for t, data in saved:
            t.data = data.float()
        with reference_experts(mtp), hand_written_kernels(False):
            yield
    finally:
        for t, data in saved:
            t.data = data
