"""Hub remote code for DeepSeek-V4 DSpark drafts: the configuration.

Thin by design: the implementation lives in the `dsv4_mtp_hf` package
(`pip install` the dsv4-mtp-hf source tree or its git repository); this file only lets
`AutoConfig.from_pretrained(repo, trust_remote_code=True)` find it.
"""

from dsv4_mtp_hf.configuration import DeepseekV4DSparkConfig

__all__ = ["DeepseekV4DSparkConfig"]
