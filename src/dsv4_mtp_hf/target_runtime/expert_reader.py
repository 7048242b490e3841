"""Read the target's routed experts from a DeepSeek-V4 release as packed FP4 bytes (issue 31).

transformers' loader widens every routed expert of the target to bf16.  This reader goes back to
the release for them: ``layers.{l}.ffn.experts.{e}.w1/w3/w2`` in any of the packed layouts the MTP
loader knows (native MXFP4, ModelOpt NVFP4, compressed-tensors NVFP4; dense BF16 experts are
quantised to MXFP4 matrix by matrix).  Headers are checked for every tensor of every layer before
any data is read; then a layer at a time is copied raw into preallocated packed buffers, so host
memory stays near one tensor.
"""

from __future__ import annotations

import re
from contextlib import ExitStack

import torch

from ..loading import formats as F
from ..loading.formats import MtpCheckpointError
from ..loading.files import read_config_dict, read_safetensors_header, read_weight_map, resolve_file
from ..loading.native import EXPERT_MATRICES, Unit, _fill_expert, validate_expert

# A release names them `layers.…`; transformers' save_pretrained (and ours, `save_packed`) `model.layers.…`.
LAYER_EXPERT = re.compile(r"^(model\.)?layers\.\d+\.ffn\.experts\.\d+\.w[123]\.")


class ReleaseExperts:
    """The routed experts of a release's decoder layers, validated from headers; :meth:`fill` copies one
    layer into an :class:`~dsv4_mtp_hf.layers.moe.FP4Experts`."""

    def __init__(self, path_or_repo, num_layers: int, num_experts: int, hidden: int, inter: int,
                 expert_format: str | None = None, hub: dict | None = None):
        hub = hub or {}
        self.source = str(path_or_repo)
        self.inter = inter
        weight_map, single = read_weight_map(path_or_repo, hub)
        self._check_config(read_config_dict(path_or_repo, hub) or {}, num_layers, num_experts, hidden, inter)
        keys = [k for k in weight_map if LAYER_EXPERT.match(k)]
        if not keys:
            raise MtpCheckpointError(
                f"{path_or_repo} holds no routed experts under `layers.{{l}}.ffn.experts.{{e}}.w1/w2/w3` (its index "
                f"lists {len(weight_map)} tensors): pass the DeepSeek-V4 release the target was loaded from."
            )
        self.prefix = "model." if keys[0].startswith("model.") else ""
        self.shard_of = {k: weight_map[k] for k in keys}
        shards = sorted(set(self.shard_of.values()))
        self.paths = {s: single or resolve_file(path_or_repo, s, hub) for s in shards}
        header: dict = {}
        for s in shards:
            h = read_safetensors_header(self.paths[s])
            header.update((k, h[k]) for k in keys if self.shard_of[k] == s and k in h)
        self.layout = F.detect_expert_layout(f"{self.prefix}layers.0.ffn.experts.0.w1", header) or F.MXFP4_NATIVE
        if self.layout.format is not None and expert_format not in (None, self.layout.format):
            raise MtpCheckpointError(
                f"This release stores the routed experts as {self.layout.name}; expert_format={expert_format!r} would "
                "need a lossy re-quantisation. Leave `expert_format` unset."
            )
        self.format = self.layout.format or expert_format or "mxfp4"
        self.units = {l: self._layer_units(l, num_experts, header, hidden, inter) for l in range(num_layers)}

    @staticmethod
    def _check_config(cfg: dict, num_layers, num_experts, hidden, inter) -> None:
        want = {"num_hidden_layers": num_layers, "n_routed_experts": num_experts, "hidden_size": hidden,
                "moe_intermediate_size": inter}
        bad = {k: (cfg[k], v) for k, v in want.items() if k in cfg and cfg[k] != v}
        if bad:
            shown = ", ".join(f"{k}: release {a}, target {b}" for k, (a, b) in bad.items())
            raise MtpCheckpointError(f"The release does not match the target ({shown}): pass the target's own release.")

    def _layer_units(self, layer: int, num_experts: int, header: dict, hidden: int, inter: int) -> list[Unit]:
        units, missing = [], []
        for e in range(num_experts):
            for m in EXPERT_MATRICES:
                srcs = self.layout.keys(f"{self.prefix}layers.{layer}.ffn.experts.{e}.{m}")
                absent = [k for k in srcs.values() if k not in header]
                if absent:
                    missing.extend(absent)
                    continue
                unit = Unit("expert", m, srcs, self.layout.name, e)
                validate_expert(unit, header, self.layout, self.format, hidden, inter)
                units.append(unit)
        if missing:
            shown = ", ".join(missing[:8]) + (", ..." if len(missing) > 8 else "")
            raise MtpCheckpointError(
                f"Layer {layer}'s routed experts are incomplete in {self.source} ({len(missing)} tensor(s) missing, "
                f"layout {self.layout.name}): {shown}."
            )
        return units

    @torch.no_grad()
    def fill(self, layer: int, experts) -> None:
        """Copy layer ``layer``'s experts into ``experts`` (an ``FP4Experts`` in :attr:`format`)."""
        bufs = {k: getattr(experts, k) for k in ("w13_weight", "w13_scale", "w2_weight", "w2_scale")}
        staged = {k: torch.empty(b.shape, dtype=b.dtype) for k, b in bufs.items()} if bufs["w13_weight"].is_cuda else bufs
        g13 = torch.ones(experts.num_experts, 2, dtype=torch.float32)
        g2 = torch.ones(experts.num_experts, dtype=torch.float32)
        with ExitStack() as stack:
            from safetensors import safe_open

            handles = {}

            def read(name: str) -> torch.Tensor:
                s = self.shard_of[name]
                if s not in handles:
                    handles[s] = stack.enter_context(safe_open(self.paths[s], framework="pt", device="cpu"))
                return handles[s].get_tensor(name)

            for u in self.units[layer]:
                _fill_expert(u, read, self.layout, self.format, staged, g13, g2, self.inter)
        if staged is not bufs:
            for k, b in bufs.items():
                b.copy_(staged[k])
        experts.w13_global_bits.copy_(g13.view(torch.int32))
        experts.w2_global_bits.copy_(g2.view(torch.int32))
