"""Tiny DeepSeek-V4 configs and models shared by the tests."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from dsv4_mtp_hf import DeepseekV4MtpConfig, DeepseekV4MtpForCausalLM

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def tiny_target_config(**overrides) -> DeepseekV4Config:
    kw = dict(
        vocab_size=320, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2,
        sliding_window=8, index_n_heads=8, index_head_dim=32, index_topk=4, partial_rotary_factor=0.25,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )
    kw.update(overrides)
    return DeepseekV4Config(**kw)


@torch.no_grad()
def randomize_(module: torch.nn.Module, generator: torch.Generator | None = None, std: float = 0.2) -> None:
    """Non-trivial random values for every float parameter/buffer (norm weights around 1,
    sinks and biases non-zero) so that no test passes on zeros."""
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if not t.is_floating_point() or "inv_freq" in name:
            continue
        noise = torch.randn(t.shape, generator=generator) * std
        if name.endswith("norm.weight") or name.endswith("layernorm.weight") or name.endswith(".scale") or name.endswith("hc_scale"):
            t.copy_(1.0 + noise)
        else:
            t.copy_(noise)


def tiny_pair(seed: int = 0, expert_format: str = "mxfp4", target_overrides=None, **mtp_overrides):
    torch.manual_seed(seed)
    tc = tiny_target_config(**(target_overrides or {}))
    target = DeepseekV4ForCausalLM(tc).eval()
    g = torch.Generator().manual_seed(seed + 1)
    randomize_(target, g, std=0.1)
    config = DeepseekV4MtpConfig.from_target_config(tc, expert_format=expert_format, **mtp_overrides)
    mtp = DeepseekV4MtpForCausalLM(config).eval()
    randomize_(mtp, g)
    mtp.bind(target)
    return target, mtp


def run_under_triton_interpreter(script: str, timeout: int = 600) -> None:
    """Run ``script`` (it prints "OK ..." when its checks pass) with ``TRITON_INTERPRET=1`` in a Python
    that has Triton -- this one, or the scratch venv /tmp/tv -- and skip when there is none."""
    import pytest

    py = sys.executable if importlib.util.find_spec("triton") is not None else "/tmp/tv/bin/python"
    if not os.path.exists(py):
        pytest.skip("no Python with Triton for TRITON_INTERPRET=1")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root / "src"), CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([py, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0 and "No module named 'triton'" in res.stderr:
        pytest.skip("Triton not importable for the interpreter")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("OK"), res.stdout
