"""Prepared GPU benchmark of the Triton kernels (``python -m kernels.bench.run``)."""
