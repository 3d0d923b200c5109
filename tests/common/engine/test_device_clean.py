"""A static check that keeps the runtime packages device-clean: every tensor they create
says where (`device=`), so that nothing lands on the CPU by default while the engine runs on
a GPU (issue 17). A call that means the host says `device="cpu"`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RUNTIME = ("common", "kernels", "kv_transfer", "prefill_node", "decode_node", "proxy")
# Factories that allocate on the default device unless told otherwise.
FACTORIES = frozenset(
    {
        "tensor",
        "empty",
        "zeros",
        "ones",
        "full",
        "arange",
        "rand",
        "randn",
        "randint",
        "as_tensor",
        "linspace",
        "eye",
        "Generator",
    }
)


def undeviced_calls(source: str) -> list[tuple[int, str]]:
    """(line, call) of each `torch.<factory>(...)` in `source` without a `device=` keyword."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        f = node.func
        if not (isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr in FACTORIES):
            continue
        if any(k.arg == "device" for k in node.keywords):
            continue
        found.append((node.lineno, f"torch.{f.attr}(...)"))
    return found


def runtime_files() -> list[Path]:
    files = []
    for package in RUNTIME:
        files += sorted(p for p in (ROOT / package).rglob("*.py") if "bench" not in p.parts)
    return files


def test_the_check_finds_a_tensor_without_a_device() -> None:
    src = "import torch\nx = torch.zeros(3)\ny = torch.zeros(3, device='cpu')\nz = x.new_zeros(2)\n"
    assert undeviced_calls(src) == [(2, "torch.zeros(...)")]


def test_the_runtime_packages_create_no_tensor_without_a_device() -> None:
    files = runtime_files()
    assert len(files) > 50  # the scan found the packages
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {call}"
        for path in files
        for line, call in undeviced_calls(path.read_text())
    ]
    if offenders:
        pytest.fail(
            "tensors created without device= (say device=... explicitly):\n" + "\n".join(offenders)
        )
