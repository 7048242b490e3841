"""Custom ops: a readable PyTorch reference per op, fast kernels registered behind it."""

from .fp4_moe import fp4_moe, fp4_moe_reference

__all__ = ["fp4_moe", "fp4_moe_reference"]
