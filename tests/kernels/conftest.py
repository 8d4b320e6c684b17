"""Triton kernels run under the interpreter on machines without CUDA; the flag is read at import time."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
