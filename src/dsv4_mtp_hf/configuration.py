"""Configuration of the DeepSeek-V4 multi-token-prediction (MTP) draft model."""

from __future__ import annotations

from transformers import PreTrainedConfig

from .fp4 import FORMATS, get_format

# Fields the MTP copies from the target's `DeepseekV4Config` (same names there).
TARGET_FIELDS = (
    "vocab_size",
    "hidden_size",
    "hc_mult",
    "hc_sinkhorn_iters",
    "hc_eps",
    "num_attention_heads",
    "head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "moe_intermediate_size",
    "scoring_func",
    "norm_topk_prob",
    "routed_scaling_factor",
    "swiglu_limit",
    "sliding_window",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "initializer_range",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)

# Fields that must agree between a draft and the target it is bound to.
BINDING_FIELDS = ("vocab_size", "hidden_size", "hc_mult", "rope_theta", "qk_rope_head_dim", "head_dim")

ATTENTION_BACKENDS = ("auto", "reference", "flashinfer")


class DeepseekV4MtpConfig(PreTrainedConfig):
    r"""Configuration of [`DeepseekV4MtpForCausalLM`]: one DeepSeek-V4 MTP layer (SPEC §1-5).

    The MTP layer is a sliding-window-only V4 decoder block (plain RoPE, no compressor)
    fed by the target's pre-`hc_head` multi-stream residual, with a score-routed FP4 MoE.
    Build it from a target config with [`~DeepseekV4MtpConfig.from_target_config`].

    MTP-specific fields:
        qk_rope_head_dim (`int`): RoPE channels, the LAST ones of each 512-dim head.
        expert_format (`str`): packed FP4 format of the routed experts, `"mxfp4"` (native
            DeepSeek release, E8M0 scale per 32) or `"nvfp4"` (E4M3 scale per 16 + fp32 global).
        max_draft_tokens (`int`): the most draft rows the MTP cache must be able to roll
            back; the cache holds `sliding_window - 1 + max_draft_tokens` entries.
        kv_fp8_roundtrip (`bool`): reproduce DeepSeek's inference-time FP8 round trip of the
            non-RoPE KV channels (per 64 values, power-of-two scales). Off by default, as in
            transformers' V4 target.
        attention_backend (`str`): the MTP attention's kernels (SPEC §8). `"auto"`: FlashInfer's
            MLA decode on CUDA for bf16/fp16 calls on the paged cache when FlashInfer imports, the
            reference otherwise (a `GraphedDrafter` keeps the reference, which torch.compile fuses);
            `"reference"`; `"flashinfer"`: FlashInfer or a clear error, never a silent fallback.
        mtp_vocab_size (`int`, *optional*): draft only over the first N vocabulary rows.
    """

    model_type = "deepseek_v4_mtp"

    vocab_size: int = 129280
    hidden_size: int = 4096
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1.0e-6
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    rms_norm_eps: float = 1.0e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 1048576
    initializer_range: float = 0.02
    num_nextn_predict_layers: int = 1
    expert_format: str = "mxfp4"
    max_draft_tokens: int = 16
    kv_fp8_roundtrip: bool = False
    attention_backend: str = "auto"
    mtp_vocab_size: int | None = None
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.validate()

    # -- validation -------------------------------------------------------------------------
    def validate(self) -> None:
        def fail(msg: str):
            raise ValueError(f"Invalid DeepseekV4MtpConfig: {msg}")

        for name in (
            "vocab_size", "hidden_size", "hc_mult", "num_attention_heads", "head_dim", "q_lora_rank",
            "o_groups", "o_lora_rank", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
            "sliding_window", "max_position_embeddings", "hc_sinkhorn_iters", "max_draft_tokens",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                fail(f"`{name}` must be a positive integer, got {value!r}.")
        if self.expert_format not in FORMATS:
            fail(f"`expert_format` must be one of {sorted(FORMATS)}, got {self.expert_format!r}.")
        group = get_format(self.expert_format).group_size
        for name in ("hidden_size", "moe_intermediate_size"):
            if getattr(self, name) % group:
                fail(
                    f"`{name}`={getattr(self, name)} must be divisible by the {self.expert_format} group size "
                    f"{group} (experts are packed FP4 along this dimension)."
                )
        if self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= self.head_dim:
            fail(f"`qk_rope_head_dim`={self.qk_rope_head_dim} must be even and in (0, head_dim={self.head_dim}].")
        if self.kv_fp8_roundtrip and (self.head_dim - self.qk_rope_head_dim) % 64:
            fail(
                f"`kv_fp8_roundtrip` quantises the {self.head_dim - self.qk_rope_head_dim} non-RoPE KV channels in "
                "blocks of 64; that count must be a multiple of 64."
            )
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            fail(
                f"num_attention_heads*head_dim={self.num_attention_heads * self.head_dim} must be divisible by "
                f"`o_groups`={self.o_groups} (grouped output projection)."
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            fail(f"`num_experts_per_tok`={self.num_experts_per_tok} exceeds `n_routed_experts`={self.n_routed_experts}.")
        if self.scoring_func != "sqrtsoftplus":
            fail(f"`scoring_func`={self.scoring_func!r}: DeepSeek-V4's MTP layer routes with 'sqrtsoftplus' only.")
        if self.n_shared_experts not in (0, 1):
            fail(f"`n_shared_experts`={self.n_shared_experts}: V4 has exactly one shared expert (or none).")
        if self.num_nextn_predict_layers != 1:
            fail(
                f"`num_nextn_predict_layers`={self.num_nextn_predict_layers}: DeepSeek-V4 ships one MTP layer; "
                "only that layer is supported (recursive drafting reuses it for K > 1)."
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            fail(f"`attention_backend` must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}.")
        if self.mtp_vocab_size is not None and not 0 < self.mtp_vocab_size <= self.vocab_size:
            fail(f"`mtp_vocab_size`={self.mtp_vocab_size} must be in (0, vocab_size={self.vocab_size}].")
        for name in ("rms_norm_eps", "hc_eps", "rope_theta", "swiglu_limit", "routed_scaling_factor"):
            if not float(getattr(self, name)) > 0:
                fail(f"`{name}` must be positive, got {getattr(self, name)!r}.")

    # -- construction from a target ------------------------------------------------------------
    @classmethod
    def from_target_config(cls, target_config, **overrides) -> DeepseekV4MtpConfig:
        """Build the MTP config from a transformers `DeepseekV4Config` (or its dict).

        The MTP layer is sliding-window only, so it uses the target's `main` RoPE (plain
        theta, no YaRN) and never the compressor settings.
        """
        cfg = target_config.to_dict() if hasattr(target_config, "to_dict") else dict(target_config)
        model_type = cfg.get("model_type")
        if model_type not in (None, "deepseek_v4"):
            raise ValueError(
                f"from_target_config expects a DeepSeek-V4 target config (model_type 'deepseek_v4'), got {model_type!r}."
            )
        kwargs = {k: cfg[k] for k in TARGET_FIELDS if k in cfg and cfg[k] is not None}
        head_dim = cfg.get("head_dim", cls.head_dim)
        rope = cfg.get("rope_parameters") or {}
        main = rope.get("main") if isinstance(rope.get("main"), dict) else None
        if main is not None:
            kwargs["rope_theta"] = main.get("rope_theta", kwargs.get("rope_theta"))
            if main.get("partial_rotary_factor") is not None:
                kwargs["qk_rope_head_dim"] = int(round(head_dim * main["partial_rotary_factor"]))
        if "qk_rope_head_dim" in cfg and cfg["qk_rope_head_dim"]:
            kwargs["qk_rope_head_dim"] = cfg["qk_rope_head_dim"]
        elif "qk_rope_head_dim" not in kwargs and cfg.get("partial_rotary_factor"):
            kwargs["qk_rope_head_dim"] = int(round(head_dim * cfg["partial_rotary_factor"]))
        nextn = cfg.get("num_nextn_predict_layers", 1)
        if nextn == 0:
            raise ValueError(
                "The target config says `num_nextn_predict_layers=0`: this checkpoint was released without an "
                "MTP layer, so there is nothing to draft with."
            )
        quant = cfg.get("quantization_config") or {}
        expert_dtype = quant.get("expert_dtype") if isinstance(quant, dict) else None
        if expert_dtype in ("fp4", "mxfp4"):
            kwargs["expert_format"] = "mxfp4"
        elif expert_dtype == "nvfp4":
            kwargs["expert_format"] = "nvfp4"
        kwargs.update(overrides)
        return cls(**kwargs)

    def binding_mismatches(self, target_config) -> list[str]:
        """Differences that make this draft unusable with `target_config` (empty if compatible)."""
        other = DeepseekV4MtpConfig.from_target_config(target_config, expert_format=self.expert_format)
        return [
            f"{name}: draft {getattr(self, name)!r} vs target {getattr(other, name)!r}"
            for name in BINDING_FIELDS
            if getattr(self, name) != getattr(other, name)
        ]
