"""DeepSeek-V4's drafters (the MTP head and DSpark) as Hugging Face transformers draft models."""

from transformers import AutoConfig, AutoModelForCausalLM

from .cache import DSparkKVCache, MtpKVCache, PagedMtpKVCache
from .configuration import DeepseekV4DSparkConfig, DeepseekV4MtpConfig
from .demo_pair import load_demo_pair
from .draft_vocab import draft_vocab_from_corpus
from .loading.detect import load_drafter
from .target_runtime import (
    DeepseekV4PackedExpertsForCausalLM,
    RollbackDeepseekV4Cache,
    graph_target,
    pack_fp4_experts,
    ungraph_target,
)
from .modeling_mtp import DeepseekV4MtpForCausalLM, DeepseekV4MtpOutput
from .modeling_dspark import DeepseekV4DSparkForCausalLM, DeepseekV4DSparkOutput

AutoConfig.register(DeepseekV4MtpConfig.model_type, DeepseekV4MtpConfig, exist_ok=True)
AutoModelForCausalLM.register(DeepseekV4MtpConfig, DeepseekV4MtpForCausalLM, exist_ok=True)
AutoConfig.register(DeepseekV4DSparkConfig.model_type, DeepseekV4DSparkConfig, exist_ok=True)
AutoModelForCausalLM.register(DeepseekV4DSparkConfig, DeepseekV4DSparkForCausalLM, exist_ok=True)

__all__ = ["DSparkKVCache", "DeepseekV4DSparkConfig", "DeepseekV4DSparkForCausalLM", "DeepseekV4DSparkOutput",
           "DeepseekV4MtpConfig", "DeepseekV4MtpForCausalLM", "DeepseekV4MtpOutput",
           "DeepseekV4PackedExpertsForCausalLM", "MtpKVCache", "PagedMtpKVCache", "RollbackDeepseekV4Cache",
           "draft_vocab_from_corpus",
           "graph_target", "load_demo_pair", "load_drafter", "pack_fp4_experts", "ungraph_target"]
__version__ = "0.1.0"
