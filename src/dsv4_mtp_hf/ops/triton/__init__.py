"""Triton (CUDA) kernels registered behind the custom ops.  Importing this package
needs Triton; ``dsv4_mtp_hf.ops`` imports it only when Triton and a CUDA device exist."""
