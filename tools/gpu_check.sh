#!/usr/bin/env bash
# The GPU checks in one run, most telling first, within one time budget: a lent GPU gives one run
# of a few minutes. Each step has its own time limit and is skipped (with a line) when less budget
# is left; acco-bench gpu writes its figures after each variant, so a step cut short keeps them.
#
#   on a lent machine (no network; docs/gpu.md, "The GPU checks"):
#     bash ../shared/gpu/prepare.sh && cp tools/gpu_check.sh .gpu/check.sh
#     then run `bash .gpu/check.sh` there with .gpu/ carried (logs and figures in $OUT)
#   on a GPU box where acco is installed: bash tools/gpu_check.sh
#
# BUDGET (seconds, default 450), OUT (default gpu-logs/), PY (default python3), METHODS (the e2e runs).
# What comes back from a lent machine is at most 8 files: every step's log goes into $OUT/check.log,
# the figures into $OUT/<step>/gpu.md and, for the first step, gpu.json: each other step's gpu.json
# is removed once it has run (its tables are in its gpu.md), 7 files at most.
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)" || exit 9
OUT=${OUT:-$PWD/gpu-logs}
BUDGET=${BUDGET:-450}
PY=${PY:-python3}
mkdir -p "$OUT"
LOGS=$(mktemp -d)
if compgen -G ".gpu/whl/*.whl" > /dev/null; then  # hydra-core and omegaconf, fetched by prepare.sh
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/whl/*.whl || exit 9
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi -L
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

step() {  # step NAME LIMIT_S COMMAND...: run under its limit if the budget still holds it
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  if ((SECONDS + limit > BUDGET)); then
    echo "== $name skipped: ${limit}s asked, $((BUDGET - SECONDS))s of the budget left"
    return
  fi
  timeout -k 5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  find "$OUT" -name gpu.json ! -path "$OUT/gpu8/*" -delete  # the tables are in gpu.md: 7 files at most
  { echo "== $name rc=$rc $((SECONDS - start))s"; cat "$LOGS/$name.log"; } >> "$OUT/check.log"
  echo "== $name rc=$rc $((SECONDS - start))s"
  tail -n "${TAILN:-30}" "$LOGS/$name.log"
}

# 1. GPT-Neo 125M, bf16, 8 x 1024: compiled and eager engine against the compiled and eager plain
#    loop (MFU, the 0.97 ratio, eager against the 140k tokens/s of the first H200 run), nanoGPT's
#    GPT-2 compiled on the same machine (the anchor the 34% comes from), the side-stream check
#    (compiled, since engine-acco-compiled runs), the one-minute micro-benchmark, and profiles of
#    the compiled engine, plain loop and nanoGPT: is the GPU busy (8 x 1024 lost ~15 ms per
#    micro-batch that 24 x 1024 did not; does nanoGPT's?), is the training thread on the CPU all the
#    while (host-bound) or waiting (a sync), and which kernels make the difference?
step gpu8 240 "$PY" -m acco_bench gpu --micro on --out "$OUT/gpu8" \
  --profile engine-acco-compiled,plain-bf16-compiled,nanogpt-compiled \
  --variants engine-acco-compiled,plain-bf16-compiled,nanogpt-compiled,engine-acco,plain-bf16
# 1b. CUDA graphs (train.compile_mode=reduce-overhead) at 8 x 1024: what they buy if the host is the bound.
step gpu8cg 100 "$PY" -m acco_bench gpu --compile-mode reduce-overhead --no-stream-check --micro off \
  --variants engine-acco-compiled,plain-bf16-compiled --profile engine-acco-compiled,plain-bf16-compiled \
  --out "$OUT/gpu8cg"
# 1c. The model's body compiled whole (train.compile_scope=model) at 8 x 1024: one compiled call per
#    micro-batch and direction instead of one per block, less host time if the host is the bound.
step gpu8whole 100 "$PY" -m acco_bench gpu --compile-scope model --no-stream-check --micro off \
  --variants engine-acco-compiled,plain-bf16-compiled --profile engine-acco-compiled,plain-bf16-compiled \
  --out "$OUT/gpu8whole"
# 1d. CUDA graphs' numbers: every method under them equals its reference, GPT-Neo's fused loss alike
#    with and without them, no graph compiled without them (a graph replaying at a wrong address
#    gives wrong numbers, not an error).
TAILN=12 step graphs 120 "$PY" -m pytest -q -rs -p no:cacheprovider --timeout 110 tests/test_cuda_graphs.py
# 2. One NCCL rank: every method equals its reference (compiled: train.compile=auto), bf16 training,
#    the overlap, peak memory against the state held at 4 x 1024.
TAILN=40 step onegpu 170 "$PY" -m pytest -q -rs -s -p no:cacheprovider --timeout 160 \
  tests/test_cuda_one_gpu.py
# 3. The paper's micro-batch, 24 x 1024; last, if the limit holds it, the local layers under the full
#    mask (-mask): what the blocked local layers buy in the whole compiled model.
step gpu24 100 "$PY" -m acco_bench gpu --batch-size 24 --no-stream-check --micro off --out "$OUT/gpu24" \
  --variants engine-acco-compiled,plain-bf16-compiled,engine-acco-compiled-mask
# 4. Training through main.py with a save (the tiny model, compiled: train.compile=auto): the
#    methods that crashed on the first GPU run (fixed; trained and saved on an H200 since).
here=$PWD
mkdir -p /tmp/e2e && cd /tmp/e2e || exit 9
for m in ${METHODS:-diloco streaming-diloco}; do
  TAILN=3 step "e2e-$m" 90 "$PY" "$here/main.py" train="$m" train.nb_steps_tot=30 train.save_step=15
done
cd "$here" || exit 9
# 5. Llama's path: Llama 3.2 1B's geometry, 4 x 1024, compiled, the fused loss over 128256 tokens;
#    both profiled: where the engine's 55 ms more per update (0.814 at world size 1) goes.
step llama3 120 "$PY" -m acco_bench gpu --model llama3 --batch-size 4 \
  --variants engine-acco-compiled,plain-bf16-compiled --no-stream-check --micro off --out "$OUT/gpu-llama" \
  --profile engine-acco-compiled,plain-bf16-compiled
echo "== done in ${SECONDS}s of ${BUDGET}s; figures in $OUT/*/gpu.md"
