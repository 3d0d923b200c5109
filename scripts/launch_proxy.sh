#!/usr/bin/env bash
# Start the proxy (`pdserve proxy`), configured from the environment; any arguments are passed
# on as extra flags. Nodes may also join later: POST /admin/nodes {"url", "role"}.
#
#   PDSERVE_HOST               address to listen on (default 127.0.0.1; 0.0.0.0 for all)
#   PDSERVE_PORT               HTTP port (default 8000)
#   PDSERVE_MODEL              model directory: tokenizer, chat template, context length
#                              (default: the built-in model; must match the nodes' model)
#   PDSERVE_PREFILL_URLS       prefill nodes, comma-separated (http://host:8100,...)
#   PDSERVE_DECODE_URLS        decode nodes, comma-separated
#   PDSERVE_COLOCATED_URLS     colocated (--role both) nodes instead of the two pools
#   PDSERVE_SERVED_MODEL_NAME  PDSERVE_MAX_MODEL_LEN  PDSERVE_LEASE_S
#   PDSERVE_INTERSTAGE_CAPACITY  PDSERVE_LOG_LEVEL
#   PDSERVE_STREAMED_KV        on | off: --kv-streaming, KV written while the prompt computes
#   PDSERVE_MAX_ACTIVE_REQUESTS  PDSERVE_EDGE_QUEUE_CAPACITY  PDSERVE_EDGE_DEADLINE_S
#                              admission at the edge (README: "Overload")
#   PDSERVE_BIN                the command (default: pdserve; e.g. "python -m common.cli")
#   PDSERVE_DRY_RUN=1          print the command instead of running it
set -euo pipefail

args=(proxy --host "${PDSERVE_HOST:-127.0.0.1}" --port "${PDSERVE_PORT:-8000}")
opt() { if [[ -n "${!1:-}" ]]; then args+=("$2" "${!1}"); fi; }
opt PDSERVE_MODEL --model
opt PDSERVE_PREFILL_URLS --prefill
opt PDSERVE_DECODE_URLS --decode
opt PDSERVE_COLOCATED_URLS --colocated
opt PDSERVE_SERVED_MODEL_NAME --served-model-name
opt PDSERVE_MAX_MODEL_LEN --max-model-len
opt PDSERVE_LEASE_S --lease-s
opt PDSERVE_INTERSTAGE_CAPACITY --interstage-capacity
opt PDSERVE_MAX_ACTIVE_REQUESTS --max-active-requests
opt PDSERVE_EDGE_QUEUE_CAPACITY --edge-queue-capacity
opt PDSERVE_EDGE_DEADLINE_S --edge-deadline-s
opt PDSERVE_LOG_LEVEL --log-level
opt PDSERVE_STREAMED_KV --kv-streaming

read -ra bin <<< "${PDSERVE_BIN:-pdserve}"
if [[ -n "${PDSERVE_DRY_RUN:-}" ]]; then
    printf '%q ' "${bin[@]}" "${args[@]}" "$@"; echo
    exit 0
fi
exec "${bin[@]}" "${args[@]}" "$@"
