"""Which device an engine runs on: `cpu`, `cuda`, `cuda:N`, or `auto` (CUDA when torch sees
a GPU, else the CPU), resolved once, when the engine is built. Model weights, the KV cache,
block tables, sampling state and every temporary of a step live on that one device; the only
host copies are the ones a step asks for by name (`.tolist()` of the sampled tokens, the
seeded rows' random draws, which come from CPU generators so that a seed gives the same token
on every device)."""

from __future__ import annotations

import re

import torch

DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")


class DeviceError(ValueError):
    """The device named cannot be used here."""


def check_device(name: str) -> str:
    """`name` if it is a device this service knows how to run on (not that it exists here)."""
    if not DEVICE_RE.fullmatch(name):
        raise DeviceError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
    return name


def resolve_device(name: str) -> torch.device:
    """The torch device `name` means on this machine; DeviceError if it has no such device."""
    check_device(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {name!r}: torch finds no CUDA device on this machine")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DeviceError(f"device {name!r}: this machine has {count} CUDA device(s)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device
