"""`DeepseekV4MtpForCausalLM`: DeepSeek-V4's multi-token-prediction layer as a transformers model.

Row p of a forward pairs the target's pre-`hc_head` residual ``X_p [hc_mult, D]`` with the
token ``t_{p+1}``, runs at RoPE position p, and predicts ``t_{p+2}`` (design §2)::

    e = enorm(embed(t_{p+1}));  x_j = h_proj(hnorm(X_p[j])) + e_proj(e)      (every stream j)
    x = V4 block(x)            # mHC -> attention -> mHC -> MoE (one sliding-window layer)
    logits = lm_head(norm(hc_head(x)));   residual = x  (fed back for the next draft)

The embedding and lm head belong to the target and are shared by reference: they are
never copied and never part of this model's ``state_dict``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import ModelOutput

from .cache import MtpKVCache, PagedMtpKVCache
from .configuration import DeepseekV4MtpConfig
from .draft_model import DeepseekV4DraftModel
from .layers.block import DeepseekV4DraftBlock
from .layers.hyper_connection import HyperHead
from .layers.linear import project, project_sum
from .layers.norms import RMSNorm
from .layers.rope import rope_cos_sin
from .ops.argmax import argmax_last


@dataclass
class DeepseekV4MtpOutput(ModelOutput):
    """logits ``[B, S, V]`` (prediction of ``t_{p+2}`` for each row p); residual
    ``[B, S, hc_mult, D]`` (the MTP's own pre-``hc_head`` streams); the updated cache."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    cache: MtpKVCache | None = None  # transformers >= 5.24 names caches `cache`

    @property
    def past_key_values(self) -> MtpKVCache | None:
        return self.cache


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class DeepseekV4MtpForCausalLM(DeepseekV4DraftModel):
    """DeepSeek-V4's MTP layer as a speculative-decoding draft model.

    Bind it to a transformers ``DeepseekV4ForCausalLM`` (``target_model=`` here or in
    ``from_pretrained``, or :meth:`bind`), then ``target.generate(ids, assistant_model=mtp)``.
    """

    config_class = DeepseekV4MtpConfig
    config: DeepseekV4MtpConfig
    base_model_prefix = "mtp"

    def __init__(self, config: DeepseekV4MtpConfig, target_model=None):
        super().__init__(config)
        d = config.hidden_size
        self.enorm = RMSNorm(d, config.rms_norm_eps)
        self.hnorm = RMSNorm(d, config.rms_norm_eps)
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.block = DeepseekV4DraftBlock(config)
        self.hc_head = HyperHead(config.hc_mult, d, config.hc_eps, config.rms_norm_eps)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.post_init()
        self._sync_draft_vocab()
        if self.generation_config is not None:
            self.generation_config.num_assistant_tokens = 3
            self.generation_config.num_assistant_tokens_schedule = "constant"
        self._init_binding(target_model)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, target_model=None, **kwargs):
        """Load a standalone MTP checkpoint (``model_type: deepseek_v4_mtp``, ours) or the MTP
        layer of an original DeepSeek-V4 release (``model_type: deepseek_v4``, or native ``mtp.0.*``
        tensors beside a config that reads as a V4 config; only the shards holding ``mtp.*`` are
        fetched). ``device_map="auto"`` with a target places the MTP where the target's lm head lives.

        Never initialises silently: another model's checkpoint, a saved draft with a missing,
        unexpected or mis-shaped tensor, and truncated files raise :class:`MtpCheckpointError`."""
        from .loading import checkpoint_kind, load_native_mtp, load_saved_draft
        from .loading.native import lm_head_device

        kind, v4_config = checkpoint_kind(pretrained_model_name_or_path, kwargs)
        if kind == "native" and not args:
            if v4_config is not None:
                kwargs["config"] = v4_config
            return load_native_mtp(cls, pretrained_model_name_or_path, target_model=target_model, **kwargs)
        if target_model is not None and kwargs.get("device_map") == "auto":
            kwargs["device_map"] = {"": lm_head_device(target_model)}
        loaded = load_saved_draft(super().from_pretrained, pretrained_model_name_or_path, *args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        if target_model is not None:
            model.bind(target_model)
        return loaded

    # -- draft vocabulary ----------------------------------------------------------------------
    def set_draft_vocab(self, token_ids: torch.Tensor | list[int] | None = None) -> None:
        """Draft only over ``token_ids`` (e.g. the most frequent tokens of your traffic, see
        :func:`dsv4_mtp_hf.draft_vocab_from_corpus`): the lm head, the dominant cost of a draft step,
        shrinks to those rows.  ``None`` drops the subset and restores ``config.mtp_vocab_size``'s choice
        (the first N ids), or the full vocabulary.

        The verifier always sees full-vocabulary logits: the MTP never drafts a token outside the subset
        (its logits are ``-inf`` there), and the target's verification keeps greedy and sampled output
        exactly what generating without the MTP gives.  A subset that misses the tokens of the text costs
        speed only (drafts rejected); a generate call whose acceptance collapses under a reduced
        vocabulary logs a warning naming that cause.

        The ids are kept (sorted, unique) in ``config.draft_vocab_ids``: ``save_pretrained`` stores them and
        ``from_pretrained`` (our loader or ``trust_remote_code``) restores them.  Change the subset through
        this method, not by editing the config in place."""
        from .configuration import normalize_draft_vocab

        vocab = self.config.vocab_size
        self.config.draft_vocab_ids = None if token_ids is None else normalize_draft_vocab(token_ids, vocab)
        self._sync_draft_vocab()

    def _sync_draft_vocab(self) -> None:
        """``_draft_ids`` (a CPU LongTensor, or None) from ``config.draft_vocab_ids``; a new tensor object each
        time, so the graphed drafters keyed by its address are rebuilt."""
        ids = self.config.draft_vocab_ids
        self._draft_head_cache = None
        self._draft_ids = None if ids is None else torch.tensor(ids, dtype=torch.long, device="cpu")

    def draft_vocab_ids(self) -> torch.Tensor | None:
        """The ids drafts are restricted to: ``config.draft_vocab_ids``, else the first
        ``config.mtp_vocab_size`` ids; None: the full vocabulary."""
        ids = getattr(self, "_draft_ids", None)
        if ids is None and self.config.mtp_vocab_size not in (None, self.config.vocab_size):
            ids = torch.arange(self.config.mtp_vocab_size)
        return ids

    def bind(self, target):
        """As :meth:`DeepseekV4DraftModel.bind`; a draft subset's head rows are gathered again from the new head."""
        self._draft_head_cache = None  # a subset's gathered head rows belong to the previous target's head
        return super().bind(target)

    def generation_finished(self, stats) -> None:
        """Called with the statistics of each finished generate call: warns once when a reduced draft
        vocabulary made acceptance collapse (:func:`~dsv4_mtp_hf.draft_vocab.warn_if_draft_vocab_collapsed`)."""
        from .draft_vocab import warn_if_draft_vocab_collapsed

        warn_if_draft_vocab_collapsed(self, stats)

    def _lm_logits(self, h: torch.Tensor, head: nn.Module, draft_vocab: bool) -> torch.Tensor:
        h = h.to(device=head.weight.device, dtype=head.weight.dtype)
        ids = self.draft_vocab_ids() if draft_vocab else None
        if ids is None:
            # One row (a batch-1 draft step) on CUDA: the skinny op streams the 1 GB head as fast as cuBLAS
            # (H200: 241.7 vs 243.9 us) without cuBLAS's memset node and its ~4 us launch gap; more rows: untimed.
            return project(h, head) if h.numel() == h.shape[-1] else head(h)
        key = (head.weight.device, head.weight.dtype, ids.numel())
        cached = getattr(self, "_draft_head_cache", None)
        if cached is None or cached[0] != key:
            ids = ids.to(head.weight.device)
            if getattr(self, "_draft_ids", None) is None:
                rows = None  # the first N rows: sliced per call, a view, no copy
            else:  # a token subset: its rows gathered once (call set_draft_vocab again if the head changes)
                rows = head.weight.detach().index_select(0, ids)
            cached = self._draft_head_cache = (key, ids, rows)
        _, ids, rows = cached
        small = nn.functional.linear(h, head.weight[: ids.numel()] if rows is None else rows)
        logits = small.new_full((*small.shape[:-1], head.weight.shape[0]), float("-inf"))
        return logits.index_copy_(-1, ids, small)

    def new_cache(self, paged: bool = False, batch_size: int = 1, **kwargs) -> MtpKVCache | PagedMtpKVCache:
        """The MTP's own KV cache: contiguous (batch shares one length) or ``paged=True``
        (block pool, per-sequence lengths and rollback, freeing of finished sequences)."""
        if not paged:
            return MtpKVCache.from_config(self.config)
        w = self.e_proj.weight
        kwargs.setdefault("device", w.device)
        kwargs.setdefault("dtype", w.dtype)
        return PagedMtpKVCache.from_config(self.config, batch_size=batch_size, **kwargs)

    # -- forward ---------------------------------------------------------------------------------
    def _check_inputs(self, input_ids, hidden_states, position_ids):
        c = self.config
        if input_ids is None or input_ids.dim() != 2:
            raise ValueError(f"`input_ids` must be [batch, seq] token ids, got {None if input_ids is None else tuple(input_ids.shape)}.")
        b, s = input_ids.shape
        expected = (b, s, c.hc_mult, c.hidden_size)
        if hidden_states is None or tuple(hidden_states.shape) != expected:
            got = None if hidden_states is None else tuple(hidden_states.shape)
            hint = ""
            if hidden_states is not None and hidden_states.dim() == 4 and hidden_states.shape[2] != c.hc_mult:
                hint = f" (hc_mult mismatch: the MTP has hc_mult={c.hc_mult})"
            elif hidden_states is not None and hidden_states.dim() == 3:
                hint = (" (looks like collapsed hidden states: the MTP needs the target's pre-hc_head residual "
                        "streams, not `output_hidden_states`)")
            raise ValueError(f"`hidden_states` must be [batch, seq, hc_mult, hidden] = {expected}, got {got}{hint}.")
        if position_ids is not None:
            if tuple(position_ids.shape) not in ((b, s), (1, s)):
                raise ValueError(f"`position_ids` must be [batch, seq] = {(b, s)}, got {tuple(position_ids.shape)}.")
        if _capturing():  # value checks would synchronise the host inside CUDA-graph capture
            return
        if int(input_ids.max()) >= c.vocab_size or int(input_ids.min()) < 0:
            raise ValueError(f"token ids must lie in [0, vocab_size={c.vocab_size}).")

    def forward_rows(self, input_ids, hidden_states, position_ids, cache, logits_to_keep: int, draft_vocab: bool,
                     attention_backend: str | None = None, attention_plans=None):
        """The forward's tensor math, no checks and no host reads: ``(logits, residual)``."""
        shared = self._shared
        device, dtype = self.e_proj.weight.device, self.e_proj.weight.dtype
        embed = shared.embed_tokens(input_ids.to(shared.embed_tokens.weight.device)).to(device=device, dtype=dtype)
        x = project_sum(self.hnorm(hidden_states.to(device=device, dtype=dtype)), self.h_proj, self.enorm(embed), self.e_proj)
        cos, sin = rope_cos_sin(position_ids, self.config.qk_rope_head_dim, self.config.rope_theta)
        residual = self.block(x, cos, sin, position_ids, cache, attention_backend, attention_plans)
        h = residual if not logits_to_keep else residual[:, -logits_to_keep:]
        h = self.norm(self.hc_head(h))
        return self._lm_logits(h, shared.lm_head, draft_vocab), residual

    def draft_logits(self, residual: torch.Tensor) -> torch.Tensor:
        """The draft-vocabulary logits ``[B, S, V]`` of the MTP's own residual rows ``[B, S, hc_mult, D]``
        (``-inf`` outside the draft vocabulary)."""
        return self._lm_logits(self.norm(self.hc_head(residual)), self._require_bound().lm_head, draft_vocab=True)

    def draft_step(self, tokens: torch.Tensor, residual: torch.Tensor, cache: PagedMtpKVCache, draft_vocab: bool = False,
                   attention_backend: str | None = None, attention_plans=None):
        """One greedy draft row per sequence on a paged cache, at each sequence's own length:
        ``tokens [B, 1]``, ``residual [B, 1, hc_mult, D]`` -> ``(next tokens [B, 1], logits
        [B, V], residual [B, 1, hc_mult, D])``.  Unlike :meth:`forward` it validates nothing
        and never reads a value back to the host, so ``torch.compile(fullgraph=True)`` and
        CUDA graphs take it whole; callers pass valid ids (e.g. the previous step's argmax).
        ``attention_backend`` / ``attention_plans``: as in :meth:`MtpAttention.forward`."""
        positions = cache.seq_lengths.clone().unsqueeze(1)  # a copy: the cache advances its lengths in place
        logits, residual = self.forward_rows(tokens, residual, positions, cache, 1, draft_vocab, attention_backend,
                                      attention_plans)
        logits = logits[:, -1]
        return argmax_last(logits).unsqueeze(-1), logits, residual

    def forward(
        self,
        input_ids: torch.LongTensor,
        hidden_states: torch.Tensor,
        position_ids: torch.LongTensor | None = None,
        past_key_values: MtpKVCache | None = None,
        use_cache: bool = False,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int = 0,
        cache: MtpKVCache | None = None,
        draft_vocab: bool = False,
        attention_backend: str | None = None,
        **kwargs,
    ) -> DeepseekV4MtpOutput:
        """Row p: residual ``hidden_states[:, p]`` of the target at position p, token
        ``input_ids[:, p] = t_{p+1}``; predicts ``t_{p+2}``.  ``labels[:, p]`` (optional) is
        that ``t_{p+2}``; -100 ignores a row.  ``draft_vocab=True`` computes logits only for
        the draft vocabulary (see :meth:`set_draft_vocab`); the other entries are ``-inf``.
        ``attention_backend`` overrides ``config.attention_backend`` for this call."""
        self._require_bound()
        if cache is not None:
            past_key_values = cache
        self._check_inputs(input_ids, hidden_states, position_ids)
        if past_key_values is None and use_cache:
            past_key_values = self.new_cache()
        b, s = input_ids.shape
        device = self.e_proj.weight.device
        if position_ids is None:
            lengths = getattr(past_key_values, "seq_lengths", None)  # per-sequence (paged cache)
            if lengths is not None:
                position_ids = lengths.to(device).unsqueeze(1) + torch.arange(s, device=device)
            else:
                start = past_key_values.get_seq_length() if past_key_values is not None else 0
                position_ids = torch.arange(start, start + s, device=device).unsqueeze(0)
        position_ids = position_ids.to(device).expand(b, s)
        if not _capturing() and int(position_ids.max()) >= self.config.max_position_embeddings:
            raise ValueError(
                f"position {int(position_ids.max())} is beyond max_position_embeddings="
                f"{self.config.max_position_embeddings} of this MTP."
            )
        logits, residual = self.forward_rows(input_ids, hidden_states, position_ids, past_key_values, logits_to_keep, draft_vocab,
                                      attention_backend)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), labels.to(logits.device).reshape(-1), ignore_index=-100
            )
        return DeepseekV4MtpOutput(loss=loss, logits=logits, residual=residual, cache=past_key_values)
