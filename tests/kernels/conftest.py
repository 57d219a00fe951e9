"""Kernel tests run the Triton kernels under the Triton interpreter when no GPU is present.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` decoration runs, i.e. before a
``kernels.triton_*`` module is first imported; conftest files are imported before test modules.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
