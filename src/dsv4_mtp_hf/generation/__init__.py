"""Generation glue: binding to a V4 target, the MTP candidate generator, the rollback-able target cache."""

from .candidate import MtpCandidateGenerator
from .stats import GenerationStats
from .target_cache import CacheRollbackError, RollbackDeepseekV4Cache

__all__ = ["CacheRollbackError", "GenerationStats", "MtpCandidateGenerator", "RollbackDeepseekV4Cache"]
