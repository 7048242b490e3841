"""What drafters read from the target's forward: the outputs of chosen decoder layers.

A V4 decoder layer returns the multi-stream residual ``[B, S, hc_mult, D]`` (after its FFN's ``hc_post``).
The MTP reads the last layer's (the residual the target's ``hc_head`` collapses); DSpark reads three layers'.
transformers' ``output_hidden_states`` replaces the last entry by the collapsed, normed state, so the layers
are read by forward hooks (:class:`FeatureTap`); a graphed target writes them from its graphs
(:meth:`~.graph.TargetGraphs.take_features`).  Either way a drafter gets ``[B, S, F, hc_mult, D]``: the F
layers it asked for, in its order, for every row of the target's last forward.
"""

from __future__ import annotations

import torch


def check_layers(target, layers: list[int]) -> list[int]:
    """``layers`` as valid indices of the target's decoder layers, or an error naming the drafter's mismatch."""
    n = len(target.model.layers)
    if not layers or any(not isinstance(i, int) or not 0 <= i < n for i in layers):
        raise ValueError(f"the drafter reads target layers {layers}, but the target has {n} decoder layers "
                         "(0..{}): the drafter belongs to a target of another depth.".format(n - 1))
    return list(layers)


class FeatureTap:
    """Forward hooks on the target's decoder ``layers`` keeping the outputs of its last forward."""

    def __init__(self, target, layers: list[int]):
        self.layers = check_layers(target, layers)
        self._outputs: dict[int, torch.Tensor] = {}
        self._hooks = [target.model.layers[i].register_forward_hook(self._keeper(i)) for i in set(self.layers)]

    def _keeper(self, i: int):
        def keep(module, args, output):
            self._outputs[i] = output[0] if isinstance(output, tuple) else output

        return keep

    def take(self) -> torch.Tensor | None:
        """``[B, S, F, hc, D]`` of the last forward, once (None if the target has not run since)."""
        if len(self._outputs) < len(set(self.layers)):
            return None
        last = self._outputs[self.layers[-1]]
        out = torch.stack([self._outputs[i].to(last.device) for i in self.layers], dim=2)
        self._outputs.clear()
        return out

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._outputs = [], {}
