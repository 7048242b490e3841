"""The DeepSeek-V4 target made rollback-able and fast: transformers' ``DeepseekV4ForCausalLM`` with

* ``rollback_cache``: :class:`RollbackDeepseekV4Cache`, a transformers cache whose compressed-attention state
  (compressors, indexers, overlap) rolls back exactly after rejected drafts;
* ``batched_state`` + ``ragged``: per-sequence state as a function of the length and the target's forward
  over ragged batches (what batched speculative decoding verifies with);
* ``graph``: :func:`graph_target`, the decode step replayed as CUDA graphs of compiled layers;
* ``experts`` + ``expert_reader``: routed experts kept packed FP4 (:func:`pack_fp4_experts`,
  :class:`DeepseekV4PackedExpertsForCausalLM`), read from a release as stored;
* ``fp8_linears``: the dense projections kept FP8 as the release stores them (:func:`keep_fp8_linears`,
  :func:`quantize_fp8_linears`), run by ``dsv4_mtp::fp8_linear``;
* ``features``: what drafters read from the target's forward (layer outputs, the pre-``hc_head`` residual).

Nothing here imports ``generation/``: the draft side builds on the target, not the reverse.
"""

from .experts import DeepseekV4PackedExpertsForCausalLM, expert_bytes, pack_fp4_experts
from .fp8_linears import FP8BlockLinear, fp8_linear_bytes, keep_fp8_linears, quantize_fp8_linears
from .graph import GraphedTargetCache, TargetGraphs, graph_target, graphed, ungraph_target
from .ragged import RaggedTargetForward
from .rollback_cache import CacheRollbackError, RollbackDeepseekV4Cache

__all__ = [
    "CacheRollbackError",
    "DeepseekV4PackedExpertsForCausalLM",
    "FP8BlockLinear",
    "GraphedTargetCache",
    "RaggedTargetForward",
    "RollbackDeepseekV4Cache",
    "TargetGraphs",
    "expert_bytes",
    "fp8_linear_bytes",
    "graph_target",
    "graphed",
    "keep_fp8_linears",
    "pack_fp4_experts",
    "quantize_fp8_linears",
    "ungraph_target",
]
