"""Custom ops: a readable PyTorch reference per op, fast kernels registered behind it."""

from .fp4_moe import check_fp4_moe_inputs, fp4_moe, fp4_moe_reference, register_cuda_kernels
from .sinkhorn import sinkhorn, sinkhorn_op, sinkhorn_reference

__all__ = [
    "check_fp4_moe_inputs", "fp4_moe", "fp4_moe_reference", "register_cuda_kernels",
    "sinkhorn", "sinkhorn_op", "sinkhorn_reference",
]
