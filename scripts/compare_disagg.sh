#!/usr/bin/env bash
# Colocated vs disaggregated on the same two cores, under a prefill-heavy mixed workload.
#
#   scripts/compare_disagg.sh [--quick] [--goodput] [--deployments NAME,...] [--out DIR]
#                             [--dry-run]
#
# Runs the same seeded bench-serve workload (many short-prompt/long-output requests, the
# ongoing decodes, with long-prompt/short-output requests arriving among them; see
# scripts/mixed_workload.py) against each deployment, one after the other, each with its
# nodes pinned to the same two cores (--pin-cores):
#   colocated-1x2  `pdserve up --colocated --threads-per-node 2 --pin-cores`: one node doing
#                  both prefill and decode, torch on 2 threads, bound to cores 0-1;
#   colocated-2x1  `pdserve up --colocated 2 --threads-per-node 1 --pin-cores`: two such
#                  nodes, one core and one torch thread each; the proxy balances between them;
#   1p1d-static    `pdserve up --prefill 1 --decode 1 --threads-per-node 1 --pin-cores
#                  --disagg-mode always`: the prefill node on core 0, the decode node on core
#                  1, every prompt prefilled on the prefill node;
#   1p1d-auto      the same with `--disagg-mode auto` (conditional disaggregation: a short
#                  prompt is prefilled on the decode node when that is estimated to give an
#                  earlier first token), plus $COMPARE_AUTO_ARGS (e.g. KV streaming flags).
# --deployments (or COMPARE_DEPLOYMENTS) picks some of them, comma-separated, run in the order
# given (default: all four, in the order above). Every deployment gets COMPARE_UP_ARGS, then
# its own extra flags, last, so they win: COMPARE_COLOCATED_1X2_ARGS, COMPARE_COLOCATED_2X1_ARGS,
# COMPARE_STATIC_ARGS (1p1d-static), COMPARE_AUTO_ARGS (1p1d-auto). --dry-run prints each
# selected deployment's kind and `pdserve up` flags, and starts nothing.
# ("cores 0-1" are the first two of the CPUs this script may use.) The proxy (the `pdserve up`
# process itself) and the benchmark client are not bound: in every deployment they float over
# the same cores and take the same share, so no deployment gets a core another lacks.
# Each deployment gets a free port, is ready when its /health answers 200, is warmed up with a
# few requests, benchmarked (each run after POST /admin/reset_prefix_cache, so that no run
# finds the prompts of the one before in a cache), then stopped by pid (SIGTERM, SIGKILL after a grace period); an
# EXIT trap stops whatever is still running. Then scripts/compare_report.py writes
# DIR/report.md: the model, the objectives (SLOs) and each deployment's flags; one row per
# deployment (TTFT, TPOT, ITL p50/p99, the share of requests meeting the SLOs at the one
# rate), who wins each, the goal line of issue 15 (best 1P1D against the better colocated
# deployment: goodput >= 1.5x, ITL p99 <= 0.5x; judged only with --goodput), and the plots.
# Per deployment DIR/NAME/ holds bench.json, bench.txt, up.log, node logs and the PNGs.
#
# --goodput adds, per deployment after its fixed-rate run, a goodput search (`bench-serve
# --goodput-search` on the same dataset): goodput as DistServe defines it, the highest rate at
# which >= 90% of requests meet both the TTFT and the TPOT objective. It goes to
# DIR/NAME/goodput/ (search.json, search.txt, attainment_vs_rate.png and each run's plots) and
# the report gains a "Goodput (DistServe)" section: each deployment's rate, the attainment
# curve and who wins. Each search run takes about COMPARE_SEARCH_NUM_REQUESTS / rate seconds
# plus the last requests' latency: 2.5 min at 0.2 req/s, under a minute from 0.8 req/s up;
# with --dtype bfloat16 a whole four-deployment run took about 30 min (session 19).
#
# It runs on the default model, SmolLM2-135M-Instruct (COMPARE_MODEL=tiny for the
# bookkeeping-only tiny model); the defaults are sized for it. Length: ~3-4 min per deployment
# on a 2-core machine (the two-deployment script's ~6-8 min, halved; not re-timed for four);
# --quick is a smoke run: its numbers mean little. Settings (environment; the defaults are
# fixed, not derived from a run):
#   COMPARE_OUT               output directory (default out/compare, relative to the current
#                             directory; --out wins)
#   COMPARE_DEPLOYMENTS       the deployments to run, comma-separated (default
#                             colocated-1x2,colocated-2x1,1p1d-static,1p1d-auto;
#                             --deployments wins)
#   COMPARE_MODEL             --model for every deployment and the dataset's tokenizer
#                             (default smollm2-135m-instruct)
#   COMPARE_RATE              Poisson arrival rate, req/s (default 0.2)
#   COMPARE_NUM_REQUESTS      measured requests per deployment (default 30; --quick 8)
#   COMPARE_WARMUP_REQUESTS   unmeasured requests first (default 2; --quick 1)
#   COMPARE_LONG_FRACTION     share of long-prompt requests (default 0.2)
#   COMPARE_LONG_INPUT        long prompt tokens, +-20% (default 800: 640-960)
#   COMPARE_SHORT_OUTPUT      output tokens of the short-prompt requests, +-20% (default 64)
#   COMPARE_SLO_TTFT_MS       objective on TTFT (default 5000)
#   COMPARE_SLO_TPOT_MS       objective on TPOT (default 200)
#   COMPARE_SEARCH_START_RATE --goodput: the search's first rate (default COMPARE_RATE)
#   COMPARE_SEARCH_NUM_REQUESTS --goodput: requests per search run (default
#                             COMPARE_NUM_REQUESTS; more than that reuse the dataset's lines)
#   COMPARE_SEARCH_DURATION_S --goodput: instead, each search run offers its rate for this
#                             many seconds (rate x this requests, from a dataset of their own
#                             sized for the max rate). A run of 30 requests at 10 req/s is a
#                             3 s burst, over before any backlog builds: it passes rates no
#                             deployment sustains. Unset: COMPARE_SEARCH_NUM_REQUESTS.
#   COMPARE_SEARCH_MAX_RUNS   --goodput: runs per search at most (default 8; --quick 3)
#   COMPARE_SEARCH_MAX_RATE   --goodput: the search doubles no higher (default 64 x start:
#                             in bfloat16 on an AMX CPU, 1P1D passed 16 x, 3.2 req/s)
#   COMPARE_SEARCH_MIN_RATE   --goodput: the search halves no lower (default start / 4: a
#                             run of 30 requests at 0.05 req/s already takes 10 minutes;
#                             failing there reports goodput 0, below that rate)
#   COMPARE_SEARCH_TOLERANCE  --goodput: bisect until failing/passing rate - 1 <= this (0.15)
#   COMPARE_GOODPUT_ATTAINMENT --goodput: share of requests that must meet both (default 0.9)
#   COMPARE_MAX_CONCURRENCY   cap on requests in flight (default 32)
#   COMPARE_SEED              dataset, order and arrivals (default 0)
#   COMPARE_UP_ARGS           more `pdserve up` flags for every deployment, e.g.
#                             "--kv-backend zmq"
#   COMPARE_AUTO_ARGS         more flags for 1p1d-auto only, after COMPARE_UP_ARGS (empty by
#                             default; e.g. a KV streaming flag); likewise
#                             COMPARE_STATIC_ARGS (1p1d-static), COMPARE_COLOCATED_1X2_ARGS,
#                             COMPARE_COLOCATED_2X1_ARGS
#   COMPARE_STARTUP_TIMEOUT_S per deployment (default 240)
#   COMPARE_SPEED_PROBE       1 (default): before each deployment starts, time the engine
#                             offline on one thread pinned to the first core
#                             (scripts/bench_engine.py: decode batch 8, a COMPARE_LONG_INPUT
#                             prefill; the dtype of COMPARE_UP_ARGS; ~20 s) into
#                             NAME/speed-probe.json, which the report's "Machine speed"
#                             section compares: a shared machine's speed drifts between
#                             deployments. 0: no probe
#   COMPARE_CAPACITY_PROBE    1 (default): once, before the first deployment, the engine
#                             offline on one thread pinned to the first core serves the
#                             workload's first COMPARE_CAPACITY_REQUESTS requests (default
#                             100; the search's dataset with --goodput) all at once
#                             (scripts/workload_capacity.py; ~70 s on the real model in
#                             float32) into capacity.json: requests/s per core with no
#                             latency objective, a ceiling the report measures every
#                             goodput against. 0: none
#   PDSERVE_PYTHON            the Python with pdserve installed (default .venv/bin/python if
#                             present, else python3); run from this checkout (PYTHONPATH)
set -euo pipefail

needs_value() {  # needs_value FLAG VALUE...: exit 2 unless the flag has a non-empty value
    [[ -n "${2:-}" ]] || { echo "compare_disagg: $1 needs a value (try --help)" >&2; exit 2; }
}
usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; }

quick=0
goodput=0
dry_run=0
out="${COMPARE_OUT:-out/compare}"
deployments="${COMPARE_DEPLOYMENTS:-colocated-1x2,colocated-2x1,1p1d-static,1p1d-auto}"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --quick) quick=1 ;;
        --goodput) goodput=1 ;;
        --dry-run) dry_run=1 ;;
        --out) needs_value "$@"; out="$2"; shift ;;
        --deployments) needs_value "$@"; deployments="$2"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "compare_disagg: unknown argument $1 (try --help)" >&2; exit 2 ;;
    esac
    shift
done

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$(realpath -m "$out")"  # relative to where the script was started, before the cd below
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
py="${PDSERVE_PYTHON:-}"
if [[ -z "$py" ]]; then
    if [[ -x .venv/bin/python ]]; then py=.venv/bin/python; else py=python3; fi
fi
command -v curl >/dev/null || { echo "compare_disagg: needs curl" >&2; exit 2; }

model="${COMPARE_MODEL:-smollm2-135m-instruct}"
rate="${COMPARE_RATE:-0.2}"
if (( quick )); then num_default=8 warmup_default=1; else num_default=30 warmup_default=2; fi
num="${COMPARE_NUM_REQUESTS:-$num_default}"
warmup="${COMPARE_WARMUP_REQUESTS:-$warmup_default}"
long_fraction="${COMPARE_LONG_FRACTION:-0.2}"
long_input="${COMPARE_LONG_INPUT:-800}"
short_output="${COMPARE_SHORT_OUTPUT:-64}"
slo_ttft="${COMPARE_SLO_TTFT_MS:-5000}"
slo_tpot="${COMPARE_SLO_TPOT_MS:-200}"
max_conc="${COMPARE_MAX_CONCURRENCY:-32}"
search_start="${COMPARE_SEARCH_START_RATE:-$rate}"
search_num="${COMPARE_SEARCH_NUM_REQUESTS:-$num}"
search_duration="${COMPARE_SEARCH_DURATION_S:-}"
if (( quick )); then search_runs_default=3; else search_runs_default=8; fi
search_runs="${COMPARE_SEARCH_MAX_RUNS:-$search_runs_default}"
search_max_rate="${COMPARE_SEARCH_MAX_RATE:-$(awk -v r="$search_start" 'BEGIN{print r * 64}')}"
search_min_rate="${COMPARE_SEARCH_MIN_RATE:-$(awk -v r="$search_start" 'BEGIN{print r / 4}')}"
search_tolerance="${COMPARE_SEARCH_TOLERANCE:-0.15}"
attainment="${COMPARE_GOODPUT_ATTAINMENT:-0.9}"
seed="${COMPARE_SEED:-0}"
# split_args ARRAY STRING: STRING split as a shell would (quotes kept together, so that
# '--prefill-node-args="--dtype float32 --kv-cache-dtype bfloat16"' stays one flag), into ARRAY
split_args() {
    local -n into="$1"
    mapfile -t into < <("$py" -c 'import shlex, sys; print(*shlex.split(sys.argv[1]), sep="\n")' "$2")
    [[ -n "$2" ]] || into=()
}
split_args up_extra "${COMPARE_UP_ARGS:-}"
startup_timeout="${COMPARE_STARTUP_TIMEOUT_S:-240}"
speed_probe="${COMPARE_SPEED_PROBE:-1}"
capacity_probe="${COMPARE_CAPACITY_PROBE:-1}"
capacity_requests="${COMPARE_CAPACITY_REQUESTS:-100}"
probe_args=()  # the deployments' --dtype, for the speed probe
for ((i = 0; i < ${#up_extra[@]}; i++)); do
    case "${up_extra[i]}" in
        --dtype) probe_args=(--dtype "${up_extra[i + 1]:-}") ;;
        --dtype=*) probe_args=("${up_extra[i]}") ;;
    esac
done
stop_grace=60        # seconds for `pdserve up` to drain and stop its nodes after SIGTERM
request_timeout=120  # per request; the drain at the end of a run waits no longer either

say() { echo "[compare $(date +%T)] $*" >&2; }

# deployment NAME: sets `kind` (colocated | disagg, for the report's goal line) and `flags`
# (its `pdserve up` flags: its own, COMPARE_UP_ARGS, then its own COMPARE_*_ARGS, which win);
# returns 1 for an unknown NAME.
deployment() {
    local extra_var more
    case "$1" in
        colocated-1x2) kind=colocated extra_var=COMPARE_COLOCATED_1X2_ARGS
            flags=(--colocated --threads-per-node 2 --pin-cores) ;;
        colocated-2x1) kind=colocated extra_var=COMPARE_COLOCATED_2X1_ARGS
            flags=(--colocated 2 --threads-per-node 1 --pin-cores) ;;
        1p1d-static) kind=disagg extra_var=COMPARE_STATIC_ARGS
            flags=(--prefill 1 --decode 1 --threads-per-node 1 --pin-cores --disagg-mode always) ;;
        1p1d-auto) kind=disagg extra_var=COMPARE_AUTO_ARGS
            flags=(--prefill 1 --decode 1 --threads-per-node 1 --pin-cores --disagg-mode auto) ;;
        *) return 1 ;;
    esac
    split_args more "${!extra_var:-}"
    flags+=(${up_extra[@]+"${up_extra[@]}"} ${more[@]+"${more[@]}"})
}

IFS=, read -ra selected <<< "$deployments"
(( ${#selected[@]} > 0 )) || { echo "compare_disagg: --deployments is empty" >&2; exit 2; }
for name in "${selected[@]}"; do
    if ! deployment "$name"; then
        echo "compare_disagg: unknown deployment '$name' (colocated-1x2, colocated-2x1," \
            "1p1d-static, 1p1d-auto)" >&2
        exit 2
    fi
    if [[ " ${seen:-} " == *" $name "* ]]; then
        echo "compare_disagg: deployment '$name' given twice" >&2; exit 2
    fi
    seen="${seen:-} $name"
done
describe() {  # after `deployment NAME`; each flag quoted where a shell needs it
    local quoted
    quoted="$("$py" -c 'import shlex, sys; print(shlex.join(sys.argv[1:]))' "${flags[@]}")"
    echo "$1 ($kind): \`pdserve up $quoted\`"
}
if (( dry_run )); then
    for name in "${selected[@]}"; do deployment "$name"; describe "$name"; done
    exit 0
fi
mkdir -p "$out"

up_pid=""
stop_deployment() {
    [[ -n "$up_pid" ]] || return 0
    local pid="$up_pid"
    up_pid=""
    if kill -0 "$pid" 2>/dev/null; then
        # SIGTERM, not SIGINT: a background job of a non-interactive shell starts with SIGINT
        # ignored, so SIGINT would be lost if it came before `pdserve up` set its handlers.
        say "stopping pdserve up (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        local waited=0
        while kill -0 "$pid" 2>/dev/null && (( waited < stop_grace * 2 )); do
            sleep 0.5; waited=$((waited + 1))
        done
        if kill -0 "$pid" 2>/dev/null; then
            say "pid $pid still running after ${stop_grace}s: SIGKILL (its nodes die with it)"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    wait "$pid" 2>/dev/null || true
}
trap stop_deployment EXIT
trap 'exit 130' INT TERM

# start_deployment NAME UP-FLAGS...: sets up_pid and url, returns once /health answers 200.
start_deployment() {
    local name="$1"; shift
    local dir="$out/$name" port
    port="$("$py" -c 'from common.cli.node_process import free_port; print(free_port())')"
    url="http://127.0.0.1:$port"
    say "$name: pdserve up $* on $url"
    "$py" -m common.cli up --host 127.0.0.1 --port "$port" --log-dir "$dir/node-logs" --model "$model" \
        --startup-timeout-s "$startup_timeout" "$@" >"$dir/up.log" 2>&1 &
    up_pid=$!
    local deadline=$((SECONDS + startup_timeout + 30))
    until curl -sf --max-time 2 -o /dev/null "$url/health"; do
        if ! kill -0 "$up_pid" 2>/dev/null || (( SECONDS > deadline )); then
            say "$name did not get ready; the end of $dir/up.log:"
            tail -n 30 "$dir/up.log" >&2
            exit 1
        fi
        sleep 0.5
    done
    grep -E '^  (both|prefill|decode)-' "$dir/up.log" >&2 || true
}

probe() {  # probe NAME: the machine's speed now, into $out/NAME/speed-probe.json
    local name="$1" dir="$out/$1" cpu
    cpu="$("$py" -c 'import os; print(min(os.sched_getaffinity(0)))')"
    say "$name: speed probe (the engine offline, one thread on CPU $cpu)"
    if ! taskset -c "$cpu" "$py" scripts/bench_engine.py --no-transformers --model "$model" \
        --threads 1 --batches 8 --sampled-batch 0 --prompt-len 64 --output-len 32 \
        --prefill-len "$long_input" --repeats 1 ${probe_args[@]+"${probe_args[@]}"} \
        --json "$dir/speed-probe.json" >"$dir/speed-probe.txt" 2>&1; then
        say "$name: the speed probe failed (the end of $dir/speed-probe.txt below); no probe"
        tail -n 5 "$dir/speed-probe.txt" >&2
        rm -f "$dir/speed-probe.json"
    fi
}

capacity() {  # capacity DATASET: the workload's throughput ceiling, into $out/capacity.json
    local data="$1" cpu
    cpu="$("$py" -c 'import os; print(min(os.sched_getaffinity(0)))')"
    say "capacity probe: the engine offline, one thread on CPU $cpu, $capacity_requests requests at once"
    if ! taskset -c "$cpu" "$py" scripts/workload_capacity.py --model "$model" --threads 1 \
        --data "$data" --requests "$capacity_requests" ${probe_args[@]+"${probe_args[@]}"} \
        --json "$out/capacity.json" >"$out/capacity.txt" 2>&1; then
        say "the capacity probe failed (the end of $out/capacity.txt below); no ceiling"
        tail -n 5 "$out/capacity.txt" >&2
        rm -f "$out/capacity.json"
    fi
}

client_args() {  # sets `common`: the bench-serve flags every run against $url shares
    # --reset-prefix-cache: every run (the fixed-rate one, each of a search's) starts with
    # cold caches, although it re-sends the dataset's prompts (the first search runs without
    # it hit the cache 96% of the time)
    common=(--base-url "$url" --endpoint completions --dataset "$dataset" --seed "$seed"
            --max-concurrency "$max_conc" --request-timeout-s "$request_timeout"
            --drain-timeout-s "$request_timeout" --no-progress --reset-prefix-cache --save-detailed
            --cluster-token-file "$out/$name/node-logs/cluster-token")
}

bench() {  # bench NAME: warm-up, then the measured run into $out/NAME/
    local name="$1" dir="$out/$1" common
    client_args
    if (( warmup > 0 )); then
        say "$name: warm-up, $warmup requests"
        "$py" -m common.cli bench-serve "${common[@]}" --num-requests "$warmup" --rate inf \
            --seed $((seed + 1)) >"$dir/warmup.txt"
    fi
    scrape "$dir/metrics-warm.txt"
    loadavg+=("$name: load average before the run $(cut -d' ' -f1-3 /proc/loadavg)")
    say "$name: $num requests at $rate req/s"
    "$py" -m common.cli bench-serve "${common[@]}" --num-requests "$num" --rate "$rate" \
        --slo-ttft-ms "$slo_ttft" --slo-tpot-ms "$slo_tpot" \
        --json "$dir/bench.json" --plot-dir "$dir" | tee "$dir/bench.txt"
    scrape "$dir/metrics-bench.txt"
}

scrape() {  # scrape FILE: the proxy's /metrics (where it placed each prompt, for the report)
    curl -sf --max-time 10 -o "$1" "$url/metrics" || { say "could not scrape $url/metrics"; rm -f "$1"; }
}

search() {  # search NAME: the goodput search into $out/NAME/goodput/
    local name="$1" dir="$out/$1/goodput" common
    client_args
    mkdir -p "$dir"
    local size=(--num-requests "$search_num") what="$search_num requests"
    if [[ -n "$search_duration" ]]; then  # open loop for that long, on prompts of their own
        size=(--duration-s "$search_duration" --dataset "$search_dataset")
        what="${search_duration} s of arrivals"
    fi
    say "$name: goodput search from $search_start req/s, at most $search_runs runs of $what"
    "$py" -m common.cli bench-serve "${common[@]}" "${size[@]}" \
        --goodput-search --rate "$search_start" --max-search-runs "$search_runs" \
        --search-max-rate "$search_max_rate" --search-min-rate "$search_min_rate" \
        --search-tolerance "$search_tolerance" \
        --goodput-attainment "$attainment" --slo-ttft-ms "$slo_ttft" --slo-tpot-ms "$slo_tpot" \
        --json "$dir/search.json" --plot-dir "$dir" | tee "$dir/search.txt"
    scrape "$out/$name/metrics-search.txt"
}

for name in "${selected[@]}"; do rm -rf "${out:?}/$name"; mkdir -p "$out/$name"; done
dataset="$out/mixed.jsonl"
"$py" scripts/mixed_workload.py --out "$dataset" --num-requests "$num" --seed "$seed" --model "$model" \
    --long-fraction "$long_fraction" --long-input "$long_input" --short-output "$short_output"
search_dataset="$out/search.jsonl"
if (( goodput )) && [[ -n "$search_duration" ]]; then
    # Enough distinct prompts for the fastest run (a prompt sent twice in one run would be
    # a prefix-cache hit the first pass did not have).
    search_lines="$(awk -v r="$search_max_rate" -v d="$search_duration" \
        'BEGIN{n = int(r * d * 1.2) + 10; print (n > 5000 ? 5000 : n)}')"
    "$py" scripts/mixed_workload.py --out "$search_dataset" --num-requests "$search_lines" \
        --seed $((seed + 7)) --model "$model" --long-fraction "$long_fraction" \
        --long-input "$long_input" --short-output "$short_output"
fi
cpus="$("$py" -c 'import os; print(len(os.sched_getaffinity(0)))')"
loadavg=()
rm -f "$out/capacity.json"
if [[ "$capacity_probe" != 0 ]]; then
    if [[ -f "$search_dataset" ]] && (( goodput )) && [[ -n "$search_duration" ]]; then
        capacity "$search_dataset"
    else
        capacity "$dataset"
    fi
fi

run_args=()
described=()
for name in "${selected[@]}"; do
    deployment "$name"
    if [[ "$speed_probe" != 0 ]]; then probe "$name"; fi
    start_deployment "$name" "${flags[@]}"
    bench "$name"
    if (( goodput )); then search "$name"; fi
    stop_deployment
    run_args+=(--run "$kind:$name=$out/$name")
    described+=("$(describe "$name")")
done

context=(
    "machine: $cpus CPUs usable ($(nproc --all) online); nodes bound to the first two, the proxy and the client unbound (they float over the same cores in every deployment)"
    "${described[@]}"
    "workload: $num requests; $(awk -v f="$long_fraction" 'BEGIN{printf "%.0f%%", (1-f)*100}') short prompt (~48 tokens) / long output (~$short_output tokens), the rest long prompt (~$long_input tokens +-20%) / short output (~12 tokens); prompt lengths exact in the model's tokens"
    "warm-up: $warmup unmeasured requests per deployment"
    "${loadavg[@]}"
)
if (( goodput )); then
    context+=("goodput search: $search_num requests a run, from $search_start req/s, at most $search_runs runs, rates $search_min_rate-$search_max_rate req/s, tolerance $search_tolerance, after the fixed-rate run")
fi
if (( quick )); then context=("**quick smoke run: too few requests for stable p99s**" "${context[@]}"); fi
ctx_args=()
for line in "${context[@]}"; do ctx_args+=(--context "$line"); done
capacity_args=()
if [[ -f "$out/capacity.json" ]]; then
    capacity_args=(--capacity "$out/capacity.json" --capacity-cores 2)  # the nodes' two cores
fi
"$py" scripts/compare_report.py "${run_args[@]}" --out "$out/report.md" "${ctx_args[@]}" \
    ${capacity_args[@]+"${capacity_args[@]}"}
say "report: $out/report.md"
