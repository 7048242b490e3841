"""Generation glue: binding to a V4 target, the MTP candidate generator, the rollback-able target cache,
grammar-constrained generation (xgrammar, optional), batched speculative decoding."""

from .candidate import MtpCandidateGenerator
from .grammar import GrammarStats, XGrammarLogitsProcessor
from .speculative import SpeculativeOutput, mtp_decoding, speculative_generate
from .stats import GenerationStats
from ..target import CacheRollbackError, GraphedTargetCache, RollbackDeepseekV4Cache, graph_target, ungraph_target

__all__ = [
    "CacheRollbackError",
    "GenerationStats",
    "GraphedTargetCache",
    "GrammarStats",
    "MtpCandidateGenerator",
    "RollbackDeepseekV4Cache",
    "SpeculativeOutput",
    "XGrammarLogitsProcessor",
    "graph_target",
    "mtp_decoding",
    "speculative_generate",
    "ungraph_target",
]
