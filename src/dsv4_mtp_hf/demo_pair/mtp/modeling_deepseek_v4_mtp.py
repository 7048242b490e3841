"""Hub remote code for DeepSeek-V4 MTP drafts: the model.

Thin by design: the implementation lives in the `dsv4_mtp_hf` package
(`pip install dsv4-mtp-hf`); this file only lets
`AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)` find it.
Bind the loaded draft to its target with `mtp.bind(target)`.
"""

from dsv4_mtp_hf.modeling_mtp import DeepseekV4MtpForCausalLM

__all__ = ["DeepseekV4MtpForCausalLM"]
