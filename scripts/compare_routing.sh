#!/usr/bin/env bash
# Routing policies and prefix caching compared on 2P2D; see scripts/compare_routing.py
# (every flag passes through: --quick, --out DIR, --deployments cost,no-cache, ...).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PDSERVE_PYTHON:-}"
if [[ -z "$py" ]]; then
    if [[ -x "$repo/.venv/bin/python" ]]; then py="$repo/.venv/bin/python"; else py=python3; fi
fi
exec "$py" "$repo/scripts/compare_routing.py" "$@"
