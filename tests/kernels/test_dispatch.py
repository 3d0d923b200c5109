"""Backend selection: auto / triton / torch, from the environment, set_backend, the engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import kernels
from common.cli.engine_args import engine_config
from common.cli.main import build_parser
from common.engine.config import EngineConfig
from kernels import dispatch
from kernels.dispatch import TORCH, KernelBackendError, kernels_for
from tests.support import procs


@pytest.fixture(autouse=True)
def _restore_default() -> Iterator[None]:
    yield
    dispatch.set_backend(None)


def test_auto_is_torch_on_cpu_and_triton_on_cuda(triton_ops):
    assert kernels_for("cpu", "auto") is TORCH
    assert kernels_for(torch.device("cuda", 0), "auto") is triton_ops


def test_forced_backends_ignore_the_device(triton_ops):
    assert kernels_for("cpu", "triton") is triton_ops
    assert kernels_for("cuda", "torch") is TORCH


def test_environment_sets_the_default(monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNELS", "Torch ")
    dispatch.set_backend(None)  # forget any earlier read
    assert dispatch.get_backend() == "torch"
    assert kernels_for("cuda") is TORCH
    monkeypatch.setenv("PDSERVE_KERNELS", "cuda")
    dispatch.set_backend(None)
    with pytest.raises(ValueError, match=r"\$PDSERVE_KERNELS: .*auto, triton, torch"):
        dispatch.get_backend()


def test_set_backend_overrides_the_environment(monkeypatch, triton_ops):
    monkeypatch.setenv("PDSERVE_KERNELS", "torch")
    kernels.set_backend("triton")
    assert kernels.get_backend() == "triton"
    assert kernels_for("cpu") is triton_ops
    with pytest.raises(ValueError, match="kernel backend must be one of"):
        kernels.set_backend("cutlass")


def test_module_functions_dispatch_per_call(monkeypatch):
    calls: list[str] = []
    spy = dispatch.Kernels(
        "spy",
        store_kv=lambda *a: calls.append("store"),
        paged_decode_attention=lambda *a: calls.append("decode"),
        paged_prefill_attention=lambda *a: calls.append("prefill"),
        pack_blocks=lambda *a: calls.append("pack"),
        unpack_blocks=lambda *a: calls.append("unpack"),
    )
    monkeypatch.setattr(dispatch, "_load_triton", lambda: spy)
    cache = torch.zeros(2, 1, 2, 4, 1, 8)
    x = torch.zeros(1, 1, 8)
    kernels.set_backend("triton")
    kernels.store_kv(cache, 0, x, x, torch.zeros(1, dtype=torch.int64))
    kernels.pack_blocks(cache, torch.zeros(1, dtype=torch.int64))
    assert calls == ["store", "pack"]
    kernels.set_backend("auto")  # CPU tensors: the reference, not the spy
    kernels.store_kv(cache, 0, x, x, torch.zeros(1, dtype=torch.int64))
    assert calls == ["store", "pack"]


def test_broken_triton_falls_back_under_auto_only(monkeypatch):
    broken = KernelBackendError("the Triton kernel backend is unavailable: ImportError()")
    monkeypatch.setattr(dispatch, "_load_triton", lambda: broken)
    assert kernels_for("cuda", "auto") is TORCH
    with pytest.raises(KernelBackendError, match="unavailable"):
        kernels_for("cuda", "triton")


@pytest.mark.e2e
def test_importing_the_engine_does_not_import_triton():
    """A machine with a broken triton still runs the torch path."""
    code = (
        "import sys, torch; pre = 'triton' in sys.modules\n"
        "import kernels, common.engine.engine, common.cli\n"
        "assert not any(m.startswith('kernels.triton') for m in sys.modules)\n"
        "assert pre or 'triton' not in sys.modules\n"
    )
    procs.run(procs.python("-c", code), timeout=120, check=True)


def test_engine_config_and_cli_carry_the_backend():
    with pytest.raises(ValueError, match="kernel_backend must be one of"):
        EngineConfig(model="m", kernel_backend="fast")
    args = build_parser().parse_args(["generate", "--prompt", "x", "--model", "m"])
    assert engine_config(args).kernel_backend is None
    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--model", "m", "--kernel-backend", "triton"]
    )
    assert engine_config(args).kernel_backend == "triton"
