#!/usr/bin/env bash
# The one-shot GPU check (issue 17): everything that needs a CUDA GPU, in one run of a few
# minutes on one H100/H200, with a JSON and a markdown report in $PDSERVE_GPU_OUT (default
# out/gpu_check):
#   1. kernels   the kernel tests on CUDA (compiled Triton, no interpreter)
#   2. stress    scripts/gpu_stress.py: bf16/fp16 against a float32 reference, NaN in every
#                unused slot (heads 32/8 and 64/8, head_dim 64/96/128, block sizes 1/16/128,
#                contexts 1 to 32k, splits auto and 1, prefill at position 30k, a cache of
#                more than 2^31 elements)
#   3. engine    the engine on CUDA: Triton vs torch (greedy), sampled rows, --device paths
#   4. service   `pdserve up`-style 1P1D, both nodes on the GPU, through the openai client,
#                equal to offline; and every KV backend (nixl VRAM to VRAM, zmq/ucxx staged)
#   5. decode    paged decode attention timing and GB/s, Triton vs torch SDPA
#   6. transfer  bench-transfer --device cuda: nixl VRAM to VRAM beside bare NIXL
#   7. steps     bench_engine on CUDA in bf16: decode tokens/s per batch size
#   8. graphs    --cuda-graphs: graphed decode equal to eager (tests), then step time, wall
#                and GPU, eager vs graphed at live batches between the captured sizes
#   9. prefill   scripts/bench_prefill.py: varlen prefill TFLOP/s against SDPA, 1k-16k tokens
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
# Environment: PDSERVE_GPU_STEPS (the steps to run, default all: kernels,stress,engine,
# service,decode,transfer,steps,graphs,prefill), PDSERVE_BENCH_ARGS (extra flags for
# scripts/bench_kernels.py), PDSERVE_PYTEST_ARGS (extra flags for pytest),
# PDSERVE_STRESS_ARGS (for gpu_stress.py, e.g. --quick).
# Exit status: 0 if every step passed; else 1.
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

OUT=${PDSERVE_GPU_OUT:-out/gpu_check}
mkdir -p "$OUT"
STEPS=${PDSERVE_GPU_STEPS:-kernels,stress,engine,service,decode,transfer,steps,graphs,prefill}
: >"$OUT/steps.tsv"
step() {  # step NAME CMD...: run it, its output to $OUT/NAME.log and the terminal
    local name=$1 started rc
    shift
    [[ ",$STEPS," == *",$name,"* ]] || return 0
    log "$name: $*"
    started=$(date +%s)
    "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - started))" >>"$OUT/steps.tsv"
}

# shellcheck disable=SC2086
step kernels "$PY" -m pytest tests/kernels -q -p no:cacheprovider ${PDSERVE_PYTEST_ARGS:-}
# shellcheck disable=SC2086
step stress "$PY" scripts/gpu_stress.py --json "$OUT/stress.json" ${PDSERVE_STRESS_ARGS:-}
step engine "$PY" -m pytest -q -p no:cacheprovider tests/common/engine/test_device.py \
    tests/common/engine/test_sampling.py tests/common/engine/test_warm_up.py
step service "$PY" -m pytest -q -p no:cacheprovider \
    "tests/e2e/test_service.py::test_openai_client_streams_chat_and_completion_equal_to_offline" \
    "tests/e2e/test_service.py::test_every_kv_backend_serves_equal_to_offline"
# shellcheck disable=SC2086
step decode "$PY" scripts/bench_kernels.py ${PDSERVE_BENCH_ARGS:-}
step transfer "$PY" -m common.cli bench-transfer --device cuda --backends nixl,zmq \
    --shapes 8b --blocks 1,64,512 --json "$OUT/transfer.json"
# (the tiny model: the GPU machine may have no network to fetch SmolLM2 from PyPI)
step steps "$PY" scripts/bench_engine.py --model tiny --device cuda --dtype bfloat16 \
    --no-transformers --batches 1,8,32 --json "$OUT/engine.json"
graphs() {
    "$PY" -m pytest -q -p no:cacheprovider tests/common/engine/test_cuda_graphs.py || return 1
    "$PY" scripts/bench_cuda_graphs.py --json "$OUT/graphs.json"
}
step graphs graphs
step prefill "$PY" scripts/bench_prefill.py --json "$OUT/prefill.json"

"$PY" scripts/gpu_report.py "$OUT"

log "summary"
cat "$OUT/steps.tsv"
if awk -F'\t' '$2 != 0 {bad = 1} END {exit !bad}' "$OUT/steps.tsv"; then exit 1; fi
exit 0
