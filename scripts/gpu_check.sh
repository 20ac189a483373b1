#!/usr/bin/env bash
# The GPU checks, prepared as one call for a session that has a GPU machine. From the repository root:
#
#     bash scripts/gpu_check.sh
#
# Budget, by construction: the step timeouts below add up to 535 s (tests/test_gpu_glue.py checks that the
# sum stays under 540 s), so the whole check fits in one 600 s device command, JIT compiles included. Each
# step runs under `timeout -s INT` (pytest then still prints its summary) with PYTHONUNBUFFERED=1 (no
# output lost in a buffer). A failing or timed-out step does not stop the later ones.
#
# Needs a Python with CuPy, a CUDA build of torch, timm, scipy and pytest: the lent H200's python3 has them
# (set PY=... for another one). Nothing is installed. All logs go into ONE archive, $OUT/gpu_check.tar.gz
# ($OUT: the folder the device tool brings back; else benchmarks/results/gpu-check-<time>/), beside
# summary.txt; the summary (under 10,000 characters) is printed last.
#
# Steps: probe (the machine, CuPy, torch); gpu_tests (tests/test_gpu.py and the GPU tests of
# test_fast_paths.py); suite_on_cupy (the suite with --backend cupy, without the slow and parity tests and
# the notebooks; test_cuda_source.py compiles with the machine's NVRTC there); nccl (the 1-rank NCCL test
# of tests/test_distributed.py: NCCL refuses two ranks on one GPU; skipped without mpi4py); three benchmarks of vit_cifar_tiny at batch 128
# (FP32, TF32, mixed float16; each says which precision each side used); train (the demo recipe on
# shapes, 300 steps, minivit against the same loop in PyTorch: images/s and accuracy).
set -u
cd "$(dirname "$0")/.."
PY="${PY:-python3}"
OUT_DIR="${OUT:-benchmarks/results/gpu-check-$(date +%Y%m%d-%H%M%S)}"
LOGS="$(mktemp -d)"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export MINIVIT_BACKEND=numpy        # the tests choose cupy with --backend; the benchmark with --device gpu
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
failed=0

step() {  # step NAME TIMEOUT_S COMMAND...: run it, keep its output in NAME.log, note rc and time
  local name=$1 limit=$2
  shift 2
  local start rc
  start=$(date +%s)
  timeout -s INT -k 10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  local line="$name: rc=$rc, $(( $(date +%s) - start )) s of ${limit} s"
  { [ "$rc" -eq 124 ] || [ "$rc" -eq 130 ] || [ "$rc" -eq 137 ]; } && line="$line  STOPPED AT ITS TIMEOUT?"
  echo "$line" >> "$SUMMARY"
  grep -E "passed|failed|error|Error|ratio|img/s|\| " "$LOGS/$name.log" | tail -n 12 | cut -c1-240 | sed 's/^/    /' >> "$SUMMARY"
  [ "$rc" -eq 0 ] || failed=1
}

nvidia-smi > "$LOGS/nvidia-smi.txt" 2>&1 || true
step probe 30 "$PY" -c "
import cupy, torch, minivit
print('cupy', cupy.__version__, 'available', cupy.cuda.is_available(), 'torch', torch.__version__,
      'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')
print('minivit sees a GPU:', minivit.gpu_available())"
step gpu_tests 100 "$PY" -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_gpu.py tests/test_fast_paths.py \
  --durations=8
step suite_on_cupy 120 "$PY" -m pytest -q -p no:cacheprovider --backend cupy -m "not slow and not parity" \
  --ignore=tests/test_notebooks.py --durations=15 tests/
step nccl 35 "$PY" -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_distributed.py  # needs mpi4py, else skips
step bench_fp32 65 env CUPY_TF32=0 "$PY" benchmarks/bench.py --device gpu --no-sweep --no-profile --repeats 3 --out "$LOGS"
step bench_tf32 50 env CUPY_TF32=1 "$PY" benchmarks/bench.py --device gpu --no-sweep --no-profile --repeats 3 --out "$LOGS"
step bench_fp16 45 env CUPY_TF32=1 "$PY" benchmarks/bench.py --device gpu --no-sweep --no-profile --no-memory --repeats 3 \
  --precision float16 --out "$LOGS"
step train 90 env CUPY_TF32=0 "$PY" scripts/gpu_train_compare.py --steps 300 --out "$LOGS"

{
  echo "---- benchmark tables (FP32, TF32, mixed float16) and the training run ----"
  for f in bench_fp32 bench_tf32 bench_fp16; do
    grep -E "^precision" "$LOGS/$f.log" | head -n 2
    sed -n '/^| model/,/^$/p' "$LOGS/$f.log" | head -n 6
  done
  sed -n '/^| demo recipe/,$p' "$LOGS/train.log" | head -n 5
} >> "$SUMMARY"
tar -czf "$OUT_DIR/gpu_check.tar.gz" -C "$LOGS" .
echo "all logs in $OUT_DIR/gpu_check.tar.gz; failed=$failed" >> "$SUMMARY"
head -c 9500 "$SUMMARY"
exit "$failed"
