#!/usr/bin/env bash
# tpcore on an offline GPU machine, in at most 8 minutes: versions, the gpu-marked tests, the CUDA probes,
# shard-on-load under torchrun and the bench's GPU part (tpcore beside its peers on NCCL ranks), each step under
# its own timeout, all results in one folder (11 files at most).
#
#   bash bench/gpu.sh [--cpu] [--wheels DIR] [OUT]      # OUT defaults to bench/results/gpu
#
# Needs only what that machine has: python3 with torch, transformers, pytest, hypothesis, safetensors,
# cloudpickle and pluggy. tpcore and its plugins come from the wheels in DIR (default dist/, built beforehand:
# python3 -m pip wheel --no-deps -w dist . plugins/*), else from an installed copy, else from this source tree
# (see bench/gpu_env.py). Nothing is downloaded. Without CUDA (or with --cpu) the CUDA steps record
# "skipped: no CUDA", the probes that mean something on CPU run there on gloo ranks, the bench runs a trial on
# tiny models, and the script exits 0 if those pass. PYTHON overrides the interpreter; PYTEST_ADDOPTS reaches
# the tests.
set -u -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-$(command -v python3 || command -v python || echo python3)}
OUT=bench/results/gpu
WHEELS=dist
CPU_FLAG=()
while (($#)); do
    case $1 in
        --cpu) CPU_FLAG=(--cpu) ;;
        --wheels) WHEELS=$2; shift ;;
        -h | --help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
        *) OUT=$1 ;;
    esac
    shift
done

# Step budgets in seconds, each killed 5 s after its budget: 20 + 20 + 145 + 120 + 45 + 100 + 6 x 5 = 480 at the most.
BUDGET_INSTALL=20 BUDGET_VERSIONS=20 BUDGET_TESTS=145 BUDGET_PROBE=120 BUDGET_SPMD=45 BUDGET_BENCH=100
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 PIP_NO_INDEX=1 PYTHONUNBUFFERED=1

mkdir -p "$OUT"
for file in versions.json pytest-gpu.xml pytest-gpu.log probe.json probe.log spmd.json spmd.log peers.md peers.png \
    peers.log summary.txt; do
    rm -f "$OUT/$file"
done
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tpcore-gpu.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
STEPS=""

# step NAME BUDGET LOG COMMAND...: run COMMAND under `timeout`, its output in LOG; record its status for the summary.
step() {
    local name=$1 budget=$2 log=$3 started=$SECONDS status rc
    shift 3
    echo "== $name (at most ${budget} s) ..." >&2
    timeout --kill-after=5 "$budget" "$@" >"$log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124 | 137) status="timeout (${budget} s)" ;;
        *) status="failed (exit $rc)" ;;
    esac
    STEPS+="$name"$'\t'"$status"$'\t'"$((SECONDS - started))"$'\n'
    echo "   $name: $status" >&2
}

skip() {  # skip NAME LOG WHY
    echo "skipped: $3" >"$2"
    STEPS+="$1"$'\t'"skipped: $3"$'\t'0$'\n'
    echo "== $1: skipped: $3" >&2
}

# 1. tpcore and the plugins importable (wheels, installed or sources); PYTHONPATH reaches every rank.
step install "$BUDGET_INSTALL" "$WORK/install.log" \
    "$PYTHON" bench/gpu_env.py pythonpath --wheels "$WHEELS" --site "$WORK/site" --provided "$WORK/provided" \
    --path-file "$WORK/pythonpath"
if [[ ! -f $WORK/pythonpath ]]; then
    cat "$WORK/install.log" >&2
    echo "tpcore cannot be made importable; nothing else can run" >&2
    exit 1
fi
PREFIX=$(cat "$WORK/pythonpath")
if [[ -n $PREFIX ]]; then
    export PYTHONPATH="$PREFIX${PYTHONPATH:+:$PYTHONPATH}"
fi

# 2. versions
step versions "$BUDGET_VERSIONS" "$WORK/versions.log" \
    "$PYTHON" bench/gpu_env.py versions "$OUT/versions.json" --site "$WORK/site" --provided "$(cat "$WORK/provided")"
CUDA=$("$PYTHON" -c 'import json, sys; print(int(json.load(open(sys.argv[1]))["cuda_available"]))' \
    "$OUT/versions.json" 2>/dev/null || echo 0)
if ((${#CPU_FLAG[@]})); then
    CUDA=0
    WHY="--cpu"
else
    WHY="no CUDA"
fi
if ((!CUDA)); then
    CPU_FLAG=(--cpu)
    # No gpu tests to run: their time goes to the steps that run on the CPU, slower there (20 + 20 + 165 + 70 + 150
    # + 5 x 5 = 450 s at the most).
    BUDGET_PROBE=165 BUDGET_SPMD=70 BUDGET_BENCH=150
fi

# 3. the gpu-marked tests: every world size up to the visible GPUs, fp16 and bf16 (the rest skip and say why)
if ((CUDA)); then
    step gpu-tests "$BUDGET_TESTS" "$OUT/pytest-gpu.log" \
        "$PYTHON" -m pytest -m gpu -v -rfEs -p no:cacheprovider --junitxml="$OUT/pytest-gpu.xml"
else
    skip gpu-tests "$OUT/pytest-gpu.log" "$WHY"
fi

# 4. the probes: CUDA paths of parallelize(), shard-on-load, gloo ranks sharing a GPU, NCCL's refusals
step probe "$BUDGET_PROBE" "$OUT/probe.log" "$PYTHON" bench/gpu_probe.py ${CPU_FLAG[@]+"${CPU_FLAG[@]}"} "$OUT"

# 5. SPMD: torchrun with one rank reads a checkpoint onto its device with ParallelEngine(1).parallelize(path)
step torchrun "$BUDGET_SPMD" "$OUT/spmd.log" bash -c '
    "$1" bench/gpu_spmd.py save "$2" && "$1" -m torch.distributed.run --standalone --nproc-per-node 1 \
        bench/gpu_spmd.py run "$2" "$3" "${@:4}"' _ "$PYTHON" "$WORK/checkpoint" "$OUT/spmd.json" ${CPU_FLAG[@]+"${CPU_FLAG[@]}"}

# 6. the bench's GPU part: tpcore (SPMD, parallelize()) beside unsplit, DTensor TP and HF tp_plan on NCCL ranks,
#    one per GPU: a Llama (forward, decode, memory, collectives), fp16/bf16, BART beam 4, ViT, N=4 with 4 GPUs. Parts
#    not started 40 s before the budget ends are skipped (peers.md says so); the file is rewritten after each part.
if ((CUDA)); then
    BENCH=(--device cuda --parts llama,half,bart,vit,n4,start)
else
    BENCH=(--quick --parts llama)  # on the CPU: a trial that the script runs end to end
fi
step bench "$BUDGET_BENCH" "$OUT/peers.log" \
    "$PYTHON" bench/peers.py "${BENCH[@]}" --budget $((BUDGET_BENCH - 40)) --output "$OUT/peers.md"

printf '%s' "$STEPS" | "$PYTHON" bench/gpu_env.py summary "$OUT"
