#!/usr/bin/env bash
# GPU check of kernels/: the kernel tests on CUDA (compiled Triton, no interpreter),
# then a timing table of paged decode attention, Triton vs torch SDPA.
#
#   scripts/gpu_check.sh                 # run from anywhere
#
# Python, the first that works:
#   1. $PDSERVE_GPU_PYTHON, used as it is (it must have torch with CUDA, triton,
#      pytest and the project's dependencies);
#   2. python3 (or $PYTHON) itself, if it already has all of that: nothing is
#      installed, which is what an offline machine needs;
#   3. a venv at $PDSERVE_GPU_VENV (default .venv-gpu), made with
#      --system-site-packages so that a CUDA torch installed system-wide is kept,
#      and `pip install -e '.[test]'` (or, if that fails, the few packages the
#      kernel tests import). If its torch still has no CUDA, a CUDA build is
#      installed from $PDSERVE_TORCH_INDEX (default the PyTorch cu128 index).
# This checkout goes first on PYTHONPATH either way, so its code is what is tested.
#
# Environment: PDSERVE_BENCH_ARGS (extra flags for scripts/bench_kernels.py),
# PDSERVE_PYTEST_ARGS (extra flags for pytest).
# Exit status: 0 if the kernel tests pass and the benchmark runs; else nonzero.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd)
log() { printf '\n== %s\n' "$*"; }
die() { printf 'gpu_check: %s\n' "$*" >&2; exit 1; }

# Everything the kernel tests import, torch on CUDA included; prints the versions.
PROBE='
import torch, triton, pytest
import common.engine.engine, common.cli, common.tiny.model, common.text.tokenizer
assert torch.cuda.is_available(), "torch " + torch.__version__ + " sees no CUDA device"
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      "on", torch.cuda.get_device_name(0))
'
probe() { PYTHONPATH="$ROOT" "$1" -c "$PROBE"; }

if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
else
    echo "gpu_check: nvidia-smi not found; relying on torch to find the GPU" >&2
fi

PY=""
if [[ -n "${PDSERVE_GPU_PYTHON:-}" ]]; then
    PY=$PDSERVE_GPU_PYTHON
    probe "$PY" || die "\$PDSERVE_GPU_PYTHON=$PY cannot run the kernel tests (see above)"
elif probe "${PYTHON:-python3}" 2>/dev/null; then
    PY=${PYTHON:-python3}
else
    VENV=${PDSERVE_GPU_VENV:-.venv-gpu}
    log "setting up $VENV"
    if [[ ! -x "$VENV/bin/python" ]]; then
        "${PYTHON:-python3}" -m venv --system-site-packages "$VENV" || die "cannot create $VENV"
    fi
    PY=$VENV/bin/python
    PIP=("$PY" -m pip install --disable-pip-version-check)
    if ! probe "$PY" 2>/dev/null; then
        # pyproject pins torch==2.13.0; keep a CUDA torch that is already there.
        if "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
            "${PIP[@]}" -e . --no-deps || die "pip install -e . failed"
            "${PIP[@]}" numpy 'pydantic>=2' 'tokenizers>=0.19' 'safetensors>=0.4' 'jinja2>=3.1' \
                'pytest>=8' 'hypothesis>=6' triton || die "installing the test dependencies failed"
        elif ! "${PIP[@]}" -e '.[test]'; then
            echo "gpu_check: pip install -e '.[test]' failed; installing the kernel tests' needs" >&2
            "${PIP[@]}" -e . --no-deps || die "pip install -e . failed"
            "${PIP[@]}" torch numpy 'pydantic>=2' 'tokenizers>=0.19' 'safetensors>=0.4' \
                'jinja2>=3.1' 'pytest>=8' 'hypothesis>=6' triton || die "installing packages failed"
        fi
    fi
    if ! "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
        INDEX=${PDSERVE_TORCH_INDEX:-https://download.pytorch.org/whl/cu128}
        log "torch in $VENV has no CUDA: installing a CUDA build from $INDEX"
        "${PIP[@]}" --force-reinstall torch==2.13.0 --index-url "$INDEX" \
            || "${PIP[@]}" --force-reinstall torch --index-url "$INDEX" \
            || die "could not install a CUDA torch (set PDSERVE_GPU_PYTHON to a ready python)"
    fi
    probe "$PY" || die "the environment in $VENV still cannot run the kernel tests (see above)"
fi

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# Compiled Triton, and the engine's own backend choice: nothing forced.
unset TRITON_INTERPRET PDSERVE_KERNELS

log "kernel tests on CUDA"
# shellcheck disable=SC2086
"$PY" -m pytest tests/kernels -q -p no:cacheprovider ${PDSERVE_PYTEST_ARGS:-}
TESTS=$?

log "paged decode attention timing"
# shellcheck disable=SC2086
"$PY" scripts/bench_kernels.py ${PDSERVE_BENCH_ARGS:-}
BENCH=$?

log "summary: kernel tests exit $TESTS, benchmark exit $BENCH"
if ((TESTS != 0)); then exit "$TESTS"; fi
exit "$BENCH"
