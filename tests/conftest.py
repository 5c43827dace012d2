"""Test-session set-up shared by every test file.

Without a GPU the Triton kernels run in the Triton interpreter, which must be
switched on before anything imports triton (k3mono.kernels.common reads it at
import time). A GPU machine keeps compiled kernels unless the caller asks.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
