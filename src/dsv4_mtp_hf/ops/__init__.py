"""Custom ops: a readable PyTorch reference per op, fast kernels registered behind it."""

from ._kernels import inductor_options
from .argmax import argmax_last
from .compressed_attention import compressed_attention, compressed_attention_reference
from .compressor import compressor_step, compressor_step_reference
from .fp4_moe import check_fp4_moe_inputs, fp4_moe, fp4_moe_reference, register_cuda_kernels
from .hyper_connection import hc_head, hc_head_reference, hc_pre, hc_pre_reference
from .indexer import indexer_topk, indexer_topk_reference
from .moe_route import hash_route, hash_route_reference, moe_route, moe_route_reference
from .mtp_moe import clamped_swiglu_op, mtp_moe, shared_expert
from .sinkhorn import sinkhorn, sinkhorn_op, sinkhorn_reference
from .skinny_linear import (
    skinny_linear,
    skinny_linear_cat,
    skinny_linear_cat_op,
    skinny_linear_cat_reference,
    skinny_linear_op,
    skinny_linear_reference,
    skinny_linear_sum,
    skinny_linear_sum_op,
    skinny_linear_sum_reference,
)

__all__ = [
    "argmax_last", "compressed_attention", "compressed_attention_reference", "compressor_step", "compressor_step_reference", "hash_route", "hash_route_reference",
    "indexer_topk", "indexer_topk_reference", "inductor_options", "check_fp4_moe_inputs", "fp4_moe", "fp4_moe_reference", "register_cuda_kernels",
    "hc_head", "hc_head_reference", "hc_pre", "hc_pre_reference", "moe_route", "moe_route_reference",
    "clamped_swiglu_op", "mtp_moe", "shared_expert",
    "sinkhorn", "sinkhorn_op", "sinkhorn_reference", "skinny_linear", "skinny_linear_cat", "skinny_linear_cat_op",
    "skinny_linear_cat_reference", "skinny_linear_op", "skinny_linear_reference", "skinny_linear_sum",
    "skinny_linear_sum_op", "skinny_linear_sum_reference",
]
