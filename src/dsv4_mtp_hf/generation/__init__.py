"""The draft side: drafters under transformers' assisted loop, our loop on a graphed target, and batches.

* ``round``: a round's rules (K, acceptance, the EOS / length cut); ``sampling``: the one sampler;
* ``drafter``: the protocol a drafter implements (``mtp_session`` + ``mtp_graph`` for the MTP);
* the drivers: ``candidate`` (transformers' loop), ``assisted_loop`` (ours), ``speculative`` (batches, with each
  drafter's batch part ``mtp_batch``, ``dspark_batch``);
* ``binding``: bind/unbind and the assisted ``generate`` calls; ``draft_length``, ``stats``, ``grammar``.
"""

from ..target_runtime import CacheRollbackError, GraphedTargetCache, RollbackDeepseekV4Cache, graph_target, ungraph_target
from .candidate import DraftCandidateGenerator
from .drafter import Drafts, DraftSession
from .grammar import GrammarStats, XGrammarLogitsProcessor
from .speculative import SpeculativeOutput, mtp_decoding, speculative_decoding, speculative_generate
from .stats import BatchGenerationStats, GenerationStats

__all__ = [
    "BatchGenerationStats",
    "CacheRollbackError",
    "DraftCandidateGenerator",
    "DraftSession",
    "Drafts",
    "GenerationStats",
    "GraphedTargetCache",
    "GrammarStats",
    "RollbackDeepseekV4Cache",
    "SpeculativeOutput",
    "XGrammarLogitsProcessor",
    "graph_target",
    "mtp_decoding",
    "speculative_decoding",
    "speculative_generate",
    "ungraph_target",
]
