#!/usr/bin/env bash
# Start a prefill node (`pdserve prefill`), configured from the environment; any arguments
# are passed on as extra flags (they win over the environment).
#
#   PDSERVE_HOST          address to bind AND to advertise (default 127.0.0.1); on a multi-host
#                         setup use this host's address as the proxy and decode nodes reach it
#   PDSERVE_PORT          HTTP port (default 8100)
#   PDSERVE_KV_PORT       KV side-channel port (default: any free port)
#   PDSERVE_KV_BACKEND    nixl | ucxx | zmq (default: the node's, nixl)
#   PDSERVE_MODEL         local HF model directory (default: the built-in model)
#   PDSERVE_NUM_BLOCKS    KV blocks            PDSERVE_BLOCK_SIZE   tokens per block
#   PDSERVE_DTYPE         auto | float32 | bfloat16
#   PDSERVE_MAX_NUM_SEQS  PDSERVE_MAX_NUM_BATCHED_TOKENS  PDSERVE_MAX_MODEL_LEN
#   PDSERVE_THREADS       torch CPU threads    PDSERVE_ENGINE_ID    PDSERVE_LOG_LEVEL
#   PDSERVE_BIN           the command (default: pdserve; e.g. "python -m common.cli")
#   PDSERVE_DRY_RUN=1     print the command instead of running it
set -euo pipefail
PDSERVE_PORT="${PDSERVE_PORT:-8100}" exec "$(dirname "$0")/_launch_node.sh" prefill "$@"
