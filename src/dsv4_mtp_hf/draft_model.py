"""What every DeepSeek-V4 drafter model shares: the target's embedding and lm head used by reference, binding
to the target, weight initialisation of the V4 draft layers, and the refusal to ``generate`` alone."""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init

from .layers.attention import GroupedOutputProjection, MtpAttention
from .layers.hyper_connection import HyperConnection, HyperHead
from .layers.moe import FP4Experts, Router
from .layers.norms import RMSNorm


class SharedTargetModules:
    """Plain holder (not an nn.Module) so the target's embedding and head are used by reference without
    being registered as a drafter's submodules or saved with its weights."""

    def __init__(self, target, embed_tokens=None, lm_head=None):
        self.target = target
        self.embed_tokens = target.get_input_embeddings() if target is not None else embed_tokens
        self.lm_head = target.get_output_embeddings() if target is not None else lm_head


class DeepseekV4DraftModel(PreTrainedModel, GenerationMixin):
    """Base of the V4 drafters: bind it to a transformers ``DeepseekV4ForCausalLM`` (``target_model=`` at
    construction or in ``from_pretrained``, or :meth:`bind`), then ``target.generate(ids, assistant_model=...)``."""

    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["DeepseekV4DraftBlock"]
    _supports_attention_backend = False
    _keep_in_fp32_modules_strict = [
        "attn_hc", "ffn_hc", "hc_head", "sinks", "e_score_correction_bias", "q_a_norm", "kv_norm",
        "input_layernorm", "post_attention_layernorm", "norm", "enorm", "hnorm", "main_norm",
    ]

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, GroupedOutputProjection, Router)):
            init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, Router):
                init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, MtpAttention):
            init.zeros_(module.sinks)
        elif isinstance(module, HyperConnection):
            init.normal_(module.fn, mean=0.0, std=std)
            init.zeros_(module.base)
            init.ones_(module.scale)
        elif isinstance(module, HyperHead):
            init.normal_(module.hc_fn, mean=0.0, std=std)
            init.zeros_(module.hc_base)
            init.ones_(module.hc_scale)
        elif isinstance(module, FP4Experts):
            _init_fp4_experts(module, std)

    # -- binding to the target -----------------------------------------------------------------
    def _init_binding(self, target_model) -> None:
        self._shared: SharedTargetModules | None = None
        self._unbound_note = ""  # why an earlier binding went, when not by this drafter's own unbind()
        self.last_generation_stats = None  # GenerationStats of the last assisted generate call
        if target_model is not None:
            self.bind(target_model)

    def use_shared_modules(self, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        """Run without a target on these copies of its embedding and lm head (a release's ``embed.weight`` /
        ``head.weight``); :meth:`bind` replaces them by the target's own.  They are never saved with the drafter."""
        if self._shared is not None and self._shared.target is not None:
            raise ValueError("this drafter is bound to a target; unbind() it first.")
        self._shared = SharedTargetModules(None, embed_tokens, lm_head)

    @property
    def target_model(self):
        return None if self._shared is None else self._shared.target

    @property
    def is_bound(self) -> bool:
        return self._shared is not None and self._shared.target is not None

    def check_target(self, target) -> None:
        """Raise if ``target`` cannot serve as this drafter's target."""
        name = type(self).__name__
        config = getattr(target, "config", None)
        if config is None or getattr(config, "model_type", None) != "deepseek_v4":
            raise TypeError(f"{name} drafts for a DeepSeek-V4 target (transformers `DeepseekV4ForCausalLM`), got "
                            f"{type(target).__name__} with model_type {getattr(config, 'model_type', None)!r}.")
        mismatches = self.config.binding_mismatches(config)
        if mismatches:
            raise ValueError(f"This {name} does not match the target model: " + "; ".join(mismatches)
                             + ". Load the drafter from the same DeepSeek-V4 release as the target.")
        head = target.get_output_embeddings()
        if head is None or head.weight.shape != (config.vocab_size, self.config.hidden_size):
            raise ValueError(f"The target has no lm head of shape [vocab_size, hidden_size] to share with {name}.")

    def bind(self, target):
        """Share ``target``'s embedding and lm head and make ``target.generate(assistant_model=self)`` work."""
        self.check_target(target)
        if self._shared is not None and self._shared.target is not None and self._shared.target is not target:
            self.unbind()
        from .generation.binding import attach  # lazy: generation builds on the model, not the reverse
        from .target_runtime.dtypes import norms_to_compute_dtype

        norms_to_compute_dtype(target)  # transformers 5.17 reloads bf16 targets with fp32 norms (a no-op on 5.18+)
        self._shared = SharedTargetModules(target)
        self._unbound_note = ""
        attach(self, target)
        return self

    def unbind(self) -> None:
        """Detach from the target; the target behaves exactly as before binding."""
        if self._shared is None or self._shared.target is None:
            self._shared = None
            return
        from .generation.binding import detach

        detach(self, self._shared.target)
        self._shared = None

    def _require_bound(self) -> SharedTargetModules:
        if self._shared is None:
            raise RuntimeError(
                f"This {type(self).__name__} is not bound to a target: its embedding and lm head are the target's. "
                "Pass `target_model=` to the constructor or `from_pretrained`, or call `drafter.bind(target)`.")
        return self._shared

    def get_input_embeddings(self):
        return None if self._shared is None else self._shared.embed_tokens

    def get_output_embeddings(self):
        return None if self._shared is None else self._shared.lm_head

    def binding_error(self, assisting: bool = True) -> str:
        """Why this drafter cannot draft here, and the fix: unbound, or bound to another target.  ``assisting``: it
        was passed as ``assistant_model`` to a target's ``generate``; else ``drafter.generate`` was called."""
        name = type(self).__name__
        if self.is_bound and assisting:
            return (f"This {name} is not bound to the target you generate with: it is bound to another "
                    f"{type(self.target_model).__name__} and drafts only for that one. Generate with that target, or "
                    "call `drafter.bind(target)` first (a drafter serves one target at a time; binding moves it).")
        if self.is_bound:
            return (f"This {name} is bound to one target (a {type(self.target_model).__name__}) and drafts only for "
                    "it: call that target's `generate(input_ids, assistant_model=drafter)`; to draft for another "
                    "target, `drafter.bind(other)` first (a drafter serves one target at a time).")
        why = self._unbound_note or "never bound: loaded or built without `target_model=`; or `unbind()` undid it"
        return (f"This {name} is not bound to a target ({why}). Bind it to the target (`drafter.bind(target)`, or "
                "`load_drafter(..., target_model=target)` / `from_pretrained(..., target_model=target)`), then call "
                "`target.generate(input_ids, assistant_model=drafter)`.")

    def generate(self, *args, **kwargs):
        """Refused: a drafter needs its target's hidden states."""
        raise RuntimeError(f"{self.binding_error(assisting=False)} A draft model needs its target's hidden states; "
                           "`drafter.generate(...)` cannot run alone.")

    def _supports_logits_to_keep(self) -> bool:
        """Refused.  transformers asks this only when it runs the drafter as a model of its own -- its own candidate
        generator, which a target's ``generate`` builds when this drafter is not bound to that target -- and would
        fail later with an unrelated error (``int('auto')`` for DSpark's draft length)."""
        raise ValueError(f"{self.binding_error()} transformers' own assisted generation cannot run a "
                         f"{type(self).__name__}: it needs the target's hidden states, which the binding supplies.")

    def save_pretrained(self, save_directory, *args, layout: str = "transformers", target_config=None, **kwargs):
        """``layout="transformers"`` (the default): transformers' ``save_pretrained`` (experts stay packed, no
        embedding/head), plus the thin Hub remote-code files and their ``auto_map`` so that
        ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` loads the drafter.

        ``layout="release"``: the drafter as DeepSeek's release stores it, for serving engines (vLLM
        ``--speculative-config '{"method": "mtp" or "dspark", "model": DIR, ...}'``, SGLang
        ``--speculative-draft-model-path DIR``): ``mtp.*`` tensors in the release's formats (FP8 + E8M0 block
        scales, MXFP4 experts, BF16; a drafter loaded from a release is written bit for bit, any other is
        quantised to those formats) and the TARGET's ``config.json`` (``model_type: deepseek_v4``, its
        ``num_hidden_layers``; ``dspark_*`` fields for DSpark only).  ``target_config``: the target's
        ``DeepseekV4Config``, its dict, or the release's path / Hub id (its ``config.json`` copied as it is, the
        faithful choice); default: the bound target's config.  The path must not contain ``eagle3``, ``eagle-``,
        ``dflash`` or (for an MTP) ``dspark``: vLLM would pick that method from it.
        ``from_pretrained(DIR, target_model=target)`` reads the export back.  See :mod:`.loading.export`."""
        from .loading import save_with_remote_code
        from .loading.export import check_layout, save_release_layout

        check_layout(layout)
        if layout == "release":
            if args:
                raise TypeError("save_pretrained(layout='release') takes keyword arguments only.")
            return save_release_layout(self, save_directory, target_config=target_config, **kwargs)
        if target_config is not None:
            raise ValueError("`target_config` is for layout='release' (the transformers layout saves the drafter's "
                             "own config).")
        return save_with_remote_code(self, super().save_pretrained, save_directory, *args, **kwargs)

    def can_generate(self) -> bool:  # keeps a generation_config (num_assistant_tokens)
        return True

    def generation_finished(self, stats) -> None:
        """Called by the generation drivers with the finished call's statistics (``last_generation_stats``);
        a drafter may check them (the MTP warns when a reduced draft vocabulary made acceptance collapse)."""


@torch.no_grad()
def _init_fp4_experts(module: FP4Experts, std: float) -> None:
    # Quantise random dense experts so a randomly initialised model is never
    # degenerate (all-zero codes would silence the routed experts).
    if module.w13_weight.is_meta or getattr(module.w13_weight, "_is_hf_initialized", False):
        return
    i, d = module.intermediate_size, module.hidden_size
    for e in range(module.num_experts):  # one expert at a time: bounded memory
        module.set_expert(e, torch.randn(i, d) * std, torch.randn(i, d) * std, torch.randn(d, i) * std)
