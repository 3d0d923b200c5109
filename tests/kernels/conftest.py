"""Kernel tests: each Triton kernel against its torch reference.

On a machine with a GPU they run on CUDA (compiled Triton); without one, on CPU
tensors under the Triton interpreter. `triton.jit` picks interpreter or compiler
when a kernel is decorated, i.e. when `kernels.triton_*` is first imported, so
TRITON_INTERPRET is set here, at collection, before any test imports those
modules. Only the Triton modules read it: the rest of the suite (torch kernels
on CPU) is unaffected, and a GPU run (scripts/gpu_check.sh) never sets it.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the kernels run: CUDA if present, else CPU under the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def triton_ops():
    """The Triton kernel table (skips the test if Triton cannot be loaded)."""
    from kernels.dispatch import KernelBackendError, triton_kernels

    try:
        return triton_kernels()
    except KernelBackendError as e:
        pytest.skip(str(e))
