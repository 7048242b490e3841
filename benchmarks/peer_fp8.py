"""transformers' own DeepSeek-V4 path on a GPU, as a benchmark peer (never imported from ``src/``).

A V4-Flash-shaped ``DeepseekV4ForCausalLM`` built the way ``from_pretrained`` builds the native FP8 release on a
CUDA GPU: the FineGrainedFP8 quantizer (``quant_method: fp8``, E8M0 128x128 block scales, ``expert_dtype: fp4``)
swaps the Linear layers for ``FP8Linear`` / ``FP8GroupedLinear`` and the routed experts for ``FP8Experts``
(int8-packed e2m1, E8M0 group-32 scales), then random weights in those formats.  transformers fetches its Triton
kernels from the Hub (``kernels-community/finegrained-fp8``); no device machine reaches the Hub, so the staged
copy of that package (``.peers/finegrained_fp8``) fills transformers' kernel global instead.  DeepGEMM (which
transformers prefers for the 128x128 FP8 linears when the ``kernels`` package can fetch it) is not staged, so the
linears run the Triton fallback -- the peer is labelled so.

On a machine without CUDA, :func:`reference_kernel` (dequantise + matmul in torch) stands in for the Triton
kernels, so the build and the measuring code run end to end on CPU at tiny size.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import types

import torch
from transformers import DeepseekV4Config, __version__ as transformers_version

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import init_hash_routers_, init_rotary_  # noqa: E402

# The native V4-Flash release's quantization config (config.json), expert dtype included.
RELEASE_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
                 "activation_scheme": "dynamic"}
# batched_generate.build_split_target's --tiny shape; o_lora_rank 128 (not 32) so the grouped FP8 output
# projection has whole 128-row scale blocks per group, which FP8GroupedLinear's scale view needs.
TINY = dict(vocab_size=1024, hidden_size=256, moe_intermediate_size=256, num_attention_heads=4, head_dim=64,
            q_lora_rank=64, o_groups=2, o_lora_rank=128, n_routed_experts=16, sliding_window=16,
            index_n_heads=8, index_head_dim=32, partial_rotary_factor=0.25,
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16})
KERNEL_ENTRY = {"matmul": "matmul_2d", "batched_matmul": "matmul_batched", "grouped_matmul": "matmul_grouped"}
DEFAULT_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".peers", "finegrained_fp8")
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def load_kernel(path: str = DEFAULT_PATH, autotune_trials: int | None = None):
    """Import the staged ``finegrained_fp8`` package from ``path``.  The Hub build generates its ``_ops.py``
    (the torch.ops namespace of its ``triton_op``s); the staged source lacks it, so one is made here.
    ``autotune_trials``: a smaller Bayesian autotune budget (and no refinement) than a user gets -- faster
    warm-up, possibly slower configs; ``None`` keeps the package's own budget."""
    init = os.path.join(path, "__init__.py")
    if not os.path.isfile(init):
        raise FileNotFoundError(f"no staged finegrained_fp8 package at {path} (copy shared/gpu/peers/finegrained_fp8 there)")
    if autotune_trials is not None:
        os.environ["FINEGRAINED_AUTOTUNE_TRIALS"] = str(autotune_trials)  # read when the kernels are decorated
    name = "finegrained_fp8"
    if not os.path.isfile(os.path.join(path, "_ops.py")) and f"{name}._ops" not in sys.modules:
        ops = types.ModuleType(f"{name}._ops")
        ops.ops = getattr(torch.ops, "_finegrained_fp8_peer")
        ops.add_op_namespace_prefix = lambda op: f"_finegrained_fp8_peer::{op}"
        sys.modules[f"{name}._ops"] = ops
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[path])
    kernel = importlib.util.module_from_spec(spec)
    sys.modules[name] = kernel
    spec.loader.exec_module(kernel)
    if autotune_trials is not None:
        from finegrained_fp8.bayesian_autotuner import BayesianAutotuner

        for mod in [m for k, m in list(sys.modules.items()) if k.startswith(f"{name}.")]:
            for obj in vars(mod).values():
                if isinstance(obj, BayesianAutotuner):
                    obj.refine = False
    return kernel


def install(kernel) -> object:
    """Fill transformers' kernel global from ``kernel`` (an object with matmul_2d / matmul_batched /
    matmul_grouped), as its Hub loader would; returns the previous value.  Checked against this
    transformers' names, since they moved between versions."""
    from transformers.integrations import finegrained_fp8 as hf

    bundle = getattr(hf, "FineGrainedFP8", None)
    if bundle is None or not hasattr(hf, "_FINEGRAINED_FP8") or not hasattr(hf, "load_finegrained_fp8_kernel"):
        raise RuntimeError(f"transformers {transformers_version}: integrations.finegrained_fp8 has no FineGrainedFP8 / "
                           "_FINEGRAINED_FP8 / load_finegrained_fp8_kernel; update benchmarks/peer_fp8.py:install")
    fields = [f.name for f in dataclasses.fields(bundle)]
    unknown = [f for f in fields if f not in KERNEL_ENTRY]
    if unknown:
        raise RuntimeError(f"transformers {transformers_version}: FineGrainedFP8 fields {fields}, unknown {unknown}")
    previous = hf._FINEGRAINED_FP8
    hf._FINEGRAINED_FP8 = bundle(**{f: getattr(kernel, KERNEL_ENTRY[f]) for f in fields})
    assert hf.load_finegrained_fp8_kernel() is hf._FINEGRAINED_FP8  # the loader returns it, no Hub call
    # DeepGEMM is not staged: without this, a `kernels` package on the device would try the Hub per call.
    os.environ["TRANSFORMERS_DISABLE_DEEPGEMM_LINEAR"] = "1"
    return previous


def restore(previous) -> None:
    from transformers.integrations import finegrained_fp8 as hf

    hf._FINEGRAINED_FP8 = previous


def _scale(s: torch.Tensor) -> torch.Tensor:
    if s.dtype == torch.uint8:  # raw E8M0 exponent bytes
        return torch.exp2(s.float() - 127)
    return s.float()


def dequantize(w: torch.Tensor, s: torch.Tensor, block_size) -> torch.Tensor:
    """float32 values of an FP8 block-scaled or int8-packed e2m1 (group-32 scaled) weight (..., N, K)."""
    if w.dtype == torch.int8:  # two e2m1 codes a byte, the low nibble first (as transformers' Fp8Dequantize)
        u = w.view(torch.uint8)
        lut = torch.tensor(E2M1, device=w.device)
        v = torch.stack([lut[(u & 15).long()], lut[(u >> 4).long()]], -1).flatten(-2)
        return v * _scale(s).repeat_interleave(v.shape[-1] // s.shape[-1], -1)
    v, s = w.float(), _scale(s)
    if block_size is None or s.numel() == 1:
        return v * s
    n, k = v.shape[-2:]
    s = s.repeat_interleave(block_size[0], -2)[..., :n, :].repeat_interleave(block_size[1], -1)[..., :k]
    return v * s


def _ref_matmul(A, B, Bs, block_size, output_dtype=None, activation_scale=None):
    return (A.float() @ dequantize(B, Bs, block_size).T).to(output_dtype or A.dtype)


def _ref_grouped(A, B, Bs, offsets, tokens_per_expert, block_size, output_dtype=None):
    out = A.new_zeros(A.shape[0], B.shape[-2], dtype=torch.float32)
    start = 0
    for e, end in enumerate(offsets.tolist()):  # rows start:end belong to expert e (sorted by expert)
        if end > start:
            out[start:end] = A[start:end].float() @ dequantize(B[e], Bs[e], block_size).T
        start = end
    return out.to(output_dtype or A.dtype)


def _ref_batched(A, B, Bs, expert_ids, block_size, output_dtype=None):
    out = A.new_zeros(A.shape[0], B.shape[-2], dtype=torch.float32)
    for e in expert_ids.unique().tolist():
        if e < B.shape[0]:  # rows past the experts are expert-parallel sentinels
            rows = expert_ids == e
            out[rows] = A[rows].float() @ dequantize(B[e], Bs[e], block_size).T
    return out.to(output_dtype or A.dtype)


def reference_kernel():
    """The three entry points in plain torch (weights dequantised, activations unquantised): the CPU path, and
    the GPU check of the Triton kernels' results."""
    return types.SimpleNamespace(matmul_2d=_ref_matmul, matmul_grouped=_ref_grouped, matmul_batched=_ref_batched)


def peer_config(layers: int, tiny: bool) -> DeepseekV4Config:
    """The benchmark's V4-Flash-shaped config (batched_generate.build_split_target), as the native release
    declares its quantization."""
    types_ = (["heavily_compressed_attention", "compressed_sparse_attention"] * layers)[:layers]
    kw = dict(num_hidden_layers=layers, layer_types=types_, mlp_layer_types=["hash_moe"] + ["moe"] * (layers - 1))
    if tiny:
        kw.update(TINY)
    # transformers 5.17 reads expert_dtype from the model config, later versions from the quantization config
    # (its config folds a top-level expert_dtype in): give it at the top level, as the release's config.json does.
    return DeepseekV4Config(**kw, quantization_config=dict(RELEASE_QUANT), expert_dtype="fp4")


@torch.no_grad()
def fill_peer_(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Random values in the release's formats, scaled like draft_step.fill_random_ fills the bf16 target:
    FP8 weights ~N(0, 2.56) under 2**-7 block scales (dequantised std 0.02); packed e2m1 experts random bytes
    under E8M0 scales 2**-9..2**-5, as our packed experts get; the rest as fill_random_."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "inv_freq" in name or name.endswith("tid2eid"):
            continue  # RoPE tables: init_rotary_; the hash table: filled after
        if t.dtype == torch.int8:
            t.copy_(torch.randint(-128, 128, t.shape, generator=gen, device=t.device, dtype=torch.int8))
        elif t.dtype in (torch.float8_e8m0fnu, torch.uint8):
            lo, hi = (118, 123) if ".experts." in name else (120, 121)
            t.view(torch.uint8).copy_(torch.randint(lo, hi, t.shape, generator=gen, device=t.device, dtype=torch.uint8))
        elif t.dtype == torch.float8_e4m3fn:
            for piece in t.view(-1).split(1 << 26):
                r = torch.empty(piece.shape, device=t.device, dtype=torch.bfloat16).normal_(0.0, 2.56, generator=gen)
                piece.copy_(r.to(torch.float8_e4m3fn))
        elif name.endswith("_scale_inv") and t.is_floating_point():  # float32 block scales (scale_fmt "float")
            t.fill_(2.0 ** -7)
        elif t.is_floating_point():
            norm = "norm" in name or name.endswith(".scale") or name.endswith("hc_scale")
            for piece in t.view(-1).split(1 << 26):
                piece.normal_(*((1.0, 0.05) if norm else (0.0, 0.02)), generator=gen)


def fp8_modules(model) -> dict[str, int]:
    """How many modules the quantizer swapped, by class name (FP8Linear, FP8GroupedLinear, FP8Experts...)."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if type(m).__module__.endswith("finegrained_fp8"):
            counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
    return counts


def build_peer(layers: int, tiny: bool, gen: torch.Generator, device: torch.device):
    """transformers' V4 on one device as ``from_pretrained`` builds the native FP8 release there: the quantizer's
    checks (CUDA only: on CPU it would switch to dequantising) and module swap on the meta model, then random
    weights where the checkpoint's would go, then the quantizer's post-load step."""
    from transformers import DeepseekV4ForCausalLM
    from transformers.quantizers import AutoHfQuantizer

    tc = peer_config(layers, tiny)
    quantizer = AutoHfQuantizer.from_config(tc.quantization_config, pre_quantized=True)
    device_map = {"": str(device)}
    if device.type == "cuda":
        quantizer.validate_environment(device_map=device_map, weights_only=True)
        if getattr(quantizer.quantization_config, "dequantize", False):
            raise RuntimeError("the FP8 quantizer chose to dequantise on this GPU (compute capability < 8.9?)")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as build_split_target: the peer's non-FP8 weights match ours
    try:
        with torch.device("meta"):
            model = DeepseekV4ForCausalLM(tc)
            quantizer.preprocess_model(model=model, dtype=torch.bfloat16, device_map=device_map,
                                       checkpoint_files=None, use_kernels=False)
    finally:
        torch.set_default_dtype(default)
    counts = fp8_modules(model)
    experts = model.model.layers[-1].mlp.experts
    if not counts.get("FP8Linear") or getattr(experts, "gate_up_proj", torch.empty(0)).dtype != torch.int8:
        raise RuntimeError(f"transformers {transformers_version}: the FP8 quantizer did not build FP8 linears and "
                           f"int8-packed FP4 experts (swapped: {counts}, experts: {type(experts).__name__})")
    model.to_empty(device=device)
    fill_peer_(model, torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen))))
    init_hash_routers_(model, tc, gen)
    init_rotary_(model, tc)
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)
    for m in model.modules():  # DeepGEMM is not staged (see install); the flag exists since 5.17
        if hasattr(m, "_deepgemm_disabled"):
            m._deepgemm_disabled = True
    return model.eval()


def tensor_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))
