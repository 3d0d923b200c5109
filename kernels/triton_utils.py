"""What the Triton kernel modules share. Importing this imports triton.

`INTERPRETED` is fixed when this module is first imported: `triton.jit` picks the
interpreter or the compiler at decoration time from `TRITON_INTERPRET`, so the
variable must be set before any `kernels.triton_*` module is imported.
"""

from __future__ import annotations

import torch
from triton import knobs

INTERPRETED: bool = bool(knobs.runtime.interpret)


def check_launchable(*tensors: object) -> None:
    """Compiled Triton needs CUDA tensors; the interpreter takes CPU ones."""
    for t in tensors:
        if isinstance(t, torch.Tensor):
            if not (t.is_cuda or INTERPRETED):
                raise ValueError(
                    f"Triton kernels need CUDA tensors, got one on {t.device} "
                    "(on CPU use the torch backend, or set TRITON_INTERPRET=1 before "
                    "kernels.triton_* is imported to run them under the interpreter)"
                )


def dot_options(dtype: torch.dtype) -> dict[str, object]:
    """The WIDEN / DOT_PRECISION constexprs of the attention kernels for `dtype`.

    16-bit operands go to tl.dot as they are (tensor cores, float32 accumulate).
    float32 ones go at full IEEE precision (not TF32), so float32 matches the
    reference tightly. Under the interpreter, which stores bfloat16 as raw uint16
    and cannot compute on it, loaded tiles are widened to float32 first: the same
    values (a 16-bit float is exact in float32), the same accumulation.
    """
    native = not INTERPRETED and dtype in (torch.bfloat16, torch.float16)
    return {"WIDEN": not native, "DOT_PRECISION": "tf32" if native else "ieee"}
