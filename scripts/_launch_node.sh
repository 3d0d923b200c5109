#!/usr/bin/env bash
# Shared by launch_prefill.sh and launch_decode.sh: `pdserve ROLE` with flags from
# PDSERVE_* variables (documented in those scripts); extra arguments pass through.
set -euo pipefail
role="$1"; shift

args=("$role" --host "${PDSERVE_HOST:-127.0.0.1}" --port "${PDSERVE_PORT}")
opt() { if [[ -n "${!1:-}" ]]; then args+=("$2" "${!1}"); fi; }
opt PDSERVE_KV_PORT --kv-port
opt PDSERVE_KV_BACKEND --kv-backend
opt PDSERVE_MODEL --model
opt PDSERVE_NUM_BLOCKS --num-blocks
opt PDSERVE_BLOCK_SIZE --block-size
opt PDSERVE_DTYPE --dtype
opt PDSERVE_MAX_NUM_SEQS --max-num-seqs
opt PDSERVE_MAX_NUM_BATCHED_TOKENS --max-num-batched-tokens
opt PDSERVE_MAX_MODEL_LEN --max-model-len
opt PDSERVE_THREADS --threads
opt PDSERVE_ENGINE_ID --engine-id
opt PDSERVE_LOG_LEVEL --log-level

read -ra bin <<< "${PDSERVE_BIN:-pdserve}"
if [[ -n "${PDSERVE_DRY_RUN:-}" ]]; then
    printf '%q ' "${bin[@]}" "${args[@]}" "$@"; echo
    exit 0
fi
exec "${bin[@]}" "${args[@]}" "$@"
