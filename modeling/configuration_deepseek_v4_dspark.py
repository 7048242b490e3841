"""Hub remote code for DeepSeek-V4 DSpark drafts: the configuration.

Thin by design: the implementation lives in the `dsv4_mtp_hf` package; this file only lets
`AutoConfig.from_pretrained(repo, trust_remote_code=True)` find it.
"""

try:
    from dsv4_mtp_hf import DeepseekV4DSparkConfig
except ModuleNotFoundError as err:
    if err.name != "dsv4_mtp_hf":
        raise
    raise ImportError("This DeepSeek-V4 DSpark drafter's code is the dsv4_mtp_hf package (not on PyPI): "
                      "pip install <path to a clone of the dsv4-mtp-hf repository>") from err

__all__ = ["DeepseekV4DSparkConfig"]
