"""Engine configuration: one frozen record, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from common.engine.device import check_device
from kernels.dispatch import BACKENDS


@dataclass(frozen=True)
class EngineConfig:
    model: str  # local HF model directory
    dtype: str = "auto"  # auto | float32 | bfloat16
    # The KV cache's: auto (the model's dtype) | float32 | bfloat16. Another dtype than the
    # model's lets a role compute in the dtype that is fastest for its phase and still hand
    # its KV to nodes computing in another (the KV's dtype is what the fingerprint checks).
    kv_cache_dtype: str = "auto"
    device: str = "auto"  # auto (CUDA when there is one, else cpu) | cpu | cuda | cuda:N
    block_size: int = 16
    num_blocks: int | None = None  # None: as many as kv_cache_memory holds
    kv_cache_memory: int = 256 * 2**20  # bytes, used when num_blocks is None
    max_num_seqs: int = 64  # running sequences per step
    max_num_batched_tokens: int = 512  # token budget per step (prefill chunk bound)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    threads: int | None = None  # torch intra-op threads on CPU (None: torch default)
    # auto | triton | torch; None: the process default ($PDSERVE_KERNELS, else auto).
    # auto runs Triton on CUDA and the torch reference on CPU (kernels/dispatch.py).
    kernel_backend: str | None = None
    # Automatic prefix caching: full blocks are shared by chained hash and kept, once free,
    # until their space is needed (block_allocator.py).
    enable_prefix_caching: bool = True
    # Decode-only steps replayed from CUDA graphs (common/engine/cuda_graphs.py); CUDA and
    # the Triton kernels only.
    cuda_graphs: bool = False
    # Weights that are 4-bit already (a Q4_1 GGUF's) also kept in int4 for decode-sized
    # steps on CPU in bfloat16 (kernels/cpu_linear.py): fewer bytes a step, same values.
    int4_weights: bool = True

    def __post_init__(self) -> None:
        check_device(self.device)
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two <= 128, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(
                f"kv_cache_dtype must be auto, float32 or bfloat16, got {self.kv_cache_dtype!r}"
            )
        if self.kernel_backend is not None and self.kernel_backend not in BACKENDS:
            raise ValueError(
                f"kernel_backend must be one of {', '.join(BACKENDS)}, got {self.kernel_backend!r}"
            )
