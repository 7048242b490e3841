"""Hub remote code for DeepSeek-V4 DSpark drafts: the model.

Thin by design: the implementation lives in the `dsv4_mtp_hf` package
(`pip install` the dsv4-mtp-hf source tree or its git repository); this file only lets
`AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)` find it.
Bind the loaded draft to its target with `drafter.bind(target)`, or load it with `target_model=target`.
"""

from dsv4_mtp_hf import DeepseekV4DSparkForCausalLM

__all__ = ["DeepseekV4DSparkForCausalLM"]
