"""Configuration of the DeepSeek-V4 multi-token-prediction (MTP) draft model."""

from __future__ import annotations

import operator

import torch
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

# A DSpark release's config.json fields; the block size and the target layers have no default to read it without.
DSPARK_FIELDS = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank")
REQUIRED_DSPARK_FIELDS = DSPARK_FIELDS[0], DSPARK_FIELDS[2]

# Fields that must agree between a draft and the target it is bound to.
BINDING_FIELDS = ("vocab_size", "hidden_size", "hc_mult", "rope_theta", "qk_rope_head_dim", "head_dim")

ATTENTION_BACKENDS = ("auto", "reference", "flashinfer")


def token_id_list(token_ids, what: str = "token ids") -> list[int]:
    """``token_ids`` (a tensor or array of any shape, or an iterable of ints) as a flat list of Python ints;
    floats, bools and strings raise an error naming ``what``."""
    if hasattr(token_ids, "reshape") and hasattr(token_ids, "tolist"):  # a tensor or an array, any shape
        if getattr(token_ids, "dtype", None) is not None and not _integer_dtype(token_ids.dtype):
            raise ValueError(f"{what} must be integers, got dtype {token_ids.dtype}.")
        token_ids = token_ids.reshape(-1).tolist()
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__iter__"):
        raise ValueError(f"{what}: expected a list of token ids, got {type(token_ids).__name__}.")
    flat = []
    for v in token_ids:
        try:
            if isinstance(v, (bool, float)):
                raise TypeError
            flat.append(operator.index(v))
        except TypeError:
            raise ValueError(f"{what} must be integers, got {v!r}.") from None
    return flat


def _integer_dtype(dtype) -> bool:
    if isinstance(dtype, torch.dtype):
        return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    return getattr(dtype, "kind", "i") in "iu"  # numpy


def normalize_draft_vocab(token_ids, vocab_size: int) -> list[int]:
    """A draft vocabulary as a sorted list of unique ints in ``[0, vocab_size)``; anything else raises."""
    ids = sorted(set(token_id_list(token_ids, "draft vocabulary ids")))
    if not ids or ids[0] < 0 or ids[-1] >= vocab_size:
        raise ValueError(f"draft vocabulary ids must be a non-empty set within [0, {vocab_size}).")
    return ids


class DeepseekV4DraftConfig(PreTrainedConfig):
    r"""What every DeepSeek-V4 drafter shares: its layers are sliding-window-only V4 decoder blocks (plain
    RoPE, no compressor, no indexer) wrapped in mHC, with a score-routed FP4 MoE, and it shares the target's
    embedding and lm head.  Build a drafter's config from its target's with ``from_target_config``.

    Drafter fields:
        qk_rope_head_dim (`int`): RoPE channels, the LAST ones of each 512-dim head.
        expert_format (`str`): packed FP4 format of the routed experts, `"mxfp4"` (native
            DeepSeek release, E8M0 scale per 32) or `"nvfp4"` (E4M3 scale per 16 + fp32 global).
        max_draft_tokens (`int`): the most draft rows the MTP cache must be able to roll
            back; the cache holds `sliding_window - 1 + max_draft_tokens` entries.
        kv_fp8_roundtrip (`bool`): reproduce DeepSeek's inference-time FP8 round trip of the
            non-RoPE KV channels (per 64 values, power-of-two scales). Off by default, as in
            transformers' V4 target.
        attention_backend (`str`): the MTP attention's kernels (design §8). `"auto"`: FlashInfer's
            MLA decode on CUDA for bf16/fp16 calls on the paged cache when FlashInfer imports, the
            reference otherwise (a `GraphedDrafter` keeps the reference, which torch.compile fuses);
            `"reference"`; `"flashinfer"`: FlashInfer or a clear error, never a silent fallback.
    """

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
    expert_format: str = "mxfp4"
    max_draft_tokens: int = 16
    kv_fp8_roundtrip: bool = False
    attention_backend: str = "auto"
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.validate()

    @classmethod
    def field_names(cls) -> set[str]:
        """Every field of this config class, its bases' included (what ``from_pretrained`` may override)."""
        return {name for c in cls.__mro__ if issubclass(c, DeepseekV4DraftConfig) for name in c.__annotations__}

    # -- validation -------------------------------------------------------------------------
    def validate(self) -> None:
        def fail(msg: str):
            raise ValueError(f"Invalid {type(self).__name__}: {msg}")

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
        if self.attention_backend not in ATTENTION_BACKENDS:
            fail(f"`attention_backend` must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}.")
        for name in ("rms_norm_eps", "hc_eps", "rope_theta", "swiglu_limit", "routed_scaling_factor"):
            if not float(getattr(self, name)) > 0:
                fail(f"`{name}` must be positive, got {getattr(self, name)!r}.")

    # -- construction from a target ------------------------------------------------------------
    @classmethod
    def from_target_config(cls, target_config, **overrides):
        """Build the drafter's config from a transformers `DeepseekV4Config` (or its dict).

        The drafter's layers are sliding-window only, so they use the target's `main` RoPE (plain
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
        kwargs.update(cls._target_fields(cfg, overrides))
        quant = cfg.get("quantization_config") or {}
        expert_dtype = quant.get("expert_dtype") if isinstance(quant, dict) else None
        if expert_dtype in ("fp4", "mxfp4"):
            kwargs["expert_format"] = "mxfp4"
        elif expert_dtype == "nvfp4":
            kwargs["expert_format"] = "nvfp4"
        kwargs.update(overrides)
        return cls(**kwargs)

    @classmethod
    def _target_fields(cls, target_config: dict, overrides: dict) -> dict:
        """This drafter's own fields read from the target's config dict (``overrides``: the caller's values)."""
        return {}

    def binding_mismatches(self, target_config) -> list[str]:
        """Differences that make this draft unusable with `target_config` (empty if compatible)."""
        other = DeepseekV4DraftConfig.from_target_config(target_config, expert_format=self.expert_format)
        return [
            f"{name}: draft {getattr(self, name)!r} vs target {getattr(other, name)!r}"
            for name in BINDING_FIELDS
            if getattr(self, name) != getattr(other, name)
        ]


class DeepseekV4MtpConfig(DeepseekV4DraftConfig):
    r"""Configuration of [`DeepseekV4MtpForCausalLM`]: one DeepSeek-V4 MTP layer (design §2).

    The MTP layer is a V4 draft layer fed by the target's pre-`hc_head` multi-stream residual
    (:class:`DeepseekV4DraftConfig`).  Build it from a target config with
    [`~DeepseekV4MtpConfig.from_target_config`].

    MTP-specific fields:
        mtp_vocab_size (`int`, *optional*): draft only over the first N token ids (``0 .. N-1``).
        draft_vocab_ids (`list[int]`, *optional*): draft only over these token ids (kept sorted and
            unique); takes precedence over `mtp_vocab_size`.  Written by
            [`~DeepseekV4MtpForCausalLM.set_draft_vocab`], so a chosen subset is saved with the draft and
            restored by `from_pretrained` (remote code included).

    A reduced draft vocabulary only shrinks the draft step's lm head (the dominant cost of a draft step at
    V4's 129280 ids) to those rows: the MTP then never proposes a token outside it.  The target still
    verifies over the full vocabulary, so the output is exactly what it would be without the MTP (greedy
    and sampled); only acceptance, and with it speed, depends on how much of the text the subset covers
    (:func:`dsv4_mtp_hf.draft_vocab_from_corpus` picks one from a corpus).
    """

    model_type = "deepseek_v4_mtp"

    num_nextn_predict_layers: int = 1
    mtp_vocab_size: int | None = None
    draft_vocab_ids: list[int] | None = None

    def validate(self) -> None:
        super().validate()
        if self.num_nextn_predict_layers != 1:
            raise ValueError(
                f"Invalid DeepseekV4MtpConfig: `num_nextn_predict_layers`={self.num_nextn_predict_layers}: DeepSeek-V4 "
                "ships one MTP layer; only that layer is supported (recursive drafting reuses it for K > 1).")
        if self.mtp_vocab_size is not None and not 0 < self.mtp_vocab_size <= self.vocab_size:
            raise ValueError(f"Invalid DeepseekV4MtpConfig: `mtp_vocab_size`={self.mtp_vocab_size} must be in "
                             f"(0, vocab_size={self.vocab_size}].")
        if self.draft_vocab_ids is not None:
            self.draft_vocab_ids = normalize_draft_vocab(self.draft_vocab_ids, self.vocab_size)

    @classmethod
    def _target_fields(cls, target_config: dict, overrides: dict) -> dict:
        if target_config.get("num_nextn_predict_layers", 1) == 0:
            raise ValueError(
                "The target config says `num_nextn_predict_layers=0`: this checkpoint was released without an "
                "MTP layer, so there is nothing to draft with.")
        return {}


class DeepseekV4DSparkConfig(DeepseekV4DraftConfig):
    r"""Configuration of [`DeepseekV4DSparkForCausalLM`]: DeepSeek-V4's DSpark drafter (design §7b).

    ``num_draft_layers`` V4 draft layers draft a block of ``dspark_block_size`` tokens in one forward from
    the anchor token and noise tokens, attending to context K/V built from the target's features at
    ``dspark_target_layer_ids``; a low-rank Markov head makes the block semi-autoregressive and a
    confidence head estimates each draft's acceptance.

    DSpark fields (the release's `config.json` names):
        dspark_block_size (`int`): drafts per block (γ; 5 in the releases).
        dspark_noise_token_id (`int`): the id filling the block after the anchor.
        dspark_target_layer_ids (`list[int]`): the target layers whose outputs feed the context K/V.
        dspark_markov_rank (`int`): the rank r of the Markov head.
        num_draft_layers (`int`): the drafter's layers (`mtp.0..N-1` in a release).
        num_target_layers (`int`): the target's decoder layers (checked when binding).

    The block size is what the drafter was trained with (the block is non-causal: another γ changes every
    row), so it is read from the release and must not exceed ``sliding_window``: no DSpark drafts a block longer
    than the context window its rows attend to (the releases: γ = 5 beside a 128-token window).
    """

    model_type = "deepseek_v4_dspark"

    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: list[int] | None = None
    dspark_markov_rank: int = 256
    num_draft_layers: int = 3
    num_target_layers: int = 43

    def validate(self) -> None:
        super().validate()

        def fail(msg: str):
            raise ValueError(f"Invalid DeepseekV4DSparkConfig: {msg}")

        for name in ("dspark_block_size", "dspark_markov_rank", "num_draft_layers", "num_target_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                fail(f"`{name}` must be a positive integer, got {value!r}.")
        if not 0 <= self.dspark_noise_token_id < self.vocab_size:
            fail(f"`dspark_noise_token_id`={self.dspark_noise_token_id} must be a token id < vocab_size={self.vocab_size}.")
        ids = self.dspark_target_layer_ids
        if ids is None:
            self.dspark_target_layer_ids = ids = list(range(self.num_target_layers - 3, self.num_target_layers))
        if not ids or any(not isinstance(i, int) or not 0 <= i < self.num_target_layers for i in ids):
            fail(f"`dspark_target_layer_ids`={ids} must name layers of the {self.num_target_layers}-layer target.")
        if self.dspark_block_size > self.sliding_window:
            fail(f"`dspark_block_size`={self.dspark_block_size} exceeds `sliding_window`={self.sliding_window}: no "
                 "DSpark drafts a block longer than the context window its rows attend to (the releases: 5 beside "
                 "128), and each round drafts the whole block and verifies up to block + 1 target rows. Use the "
                 "block size the drafter was trained with (its release's config.json); to verify fewer drafts per "
                 "round, pass `num_assistant_tokens=k` to generate.")
        if self.dspark_block_size > self.max_draft_tokens:
            self.max_draft_tokens = self.dspark_block_size  # the window caches roll back a whole block

    @classmethod
    def _target_fields(cls, target_config: dict, overrides: dict) -> dict:
        missing = [k for k in REQUIRED_DSPARK_FIELDS if target_config.get(k) is None and overrides.get(k) is None]
        if missing:
            raise ValueError(
                f"The target config has no {', '.join(missing)}, which a DSpark release's config.json carries "
                "(DeepSeek-V4-Flash-0731: dspark_block_size 5, dspark_target_layer_ids [40, 41, 42]). If it is a "
                "DSpark release's config, it is incomplete: restore the release's config.json, or pass the values "
                f"(`{missing[0]}=...`). If the target ships the MTP head instead (V4-Flash, -Pro), use "
                "DeepseekV4MtpForCausalLM.")
        out = {k: target_config[k] for k in DSPARK_FIELDS if target_config.get(k) is not None}
        out["num_target_layers"] = target_config.get("num_hidden_layers", cls.num_target_layers)
        return out

    def binding_mismatches(self, target_config) -> list[str]:
        """The base fields, and the target's layer count: DSpark reads fixed target layers' outputs."""
        out = super().binding_mismatches(target_config)
        cfg = target_config.to_dict() if hasattr(target_config, "to_dict") else dict(target_config)
        layers = cfg.get("num_hidden_layers")
        if layers != self.num_target_layers:
            out.append(f"num_target_layers: draft {self.num_target_layers} (it reads the outputs of target layers "
                       f"{self.dspark_target_layer_ids}) vs target {layers}")
        return out
