#!/usr/bin/env bash
# The GPU checks, prepared as one call for a session that has a GPU machine. From the repository root:
#
#     bash scripts/gpu_check.sh            # about 5-8 minutes on an H200
#
# Needs a Python with CuPy, a CUDA build of torch, timm, scipy and pytest: the lent H200's python3 has
# them all (set PY=... for another one). Nothing is installed. Logs and the benchmark JSON go to $OUT
# when it is set (the device tool brings that folder back), else to benchmarks/results/gpu-check-<time>/.
# The summary printed last is what to read first; each step's full output is in its .log file.
#
# Steps: 1. the machine and a CuPy/torch probe; 2. the test suite on CuPy (pytest --backend cupy);
# 3. tests/test_gpu.py and tests/test_fast_paths.py (the fused kernels against the reference);
# 4. the benchmark on the GPU with CUPY_TF32=0, then with CUPY_TF32=1 (torch's TF32 follows it), then
# mixed precision (--precision float16: minivit's float16 matmuls + LossScaler against autocast + GradScaler);
# 5. the per-layer profile on CuPy. A failing step does not stop the later ones.
set -u
cd "$(dirname "$0")/.."
PY="${PY:-python3}"
OUT_DIR="${OUT:-benchmarks/results/gpu-check-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MINIVIT_BACKEND=numpy        # the tests choose cupy with --backend; the benchmark with --device gpu
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
failed=0

step() {  # step NAME TIMEOUT_S COMMAND...: run it, keep its output in NAME.log, note rc and time
  local name=$1 limit=$2
  shift 2
  local start rc
  start=$(date +%s)
  timeout "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  rc=$?
  local line="$name: rc=$rc, $(( $(date +%s) - start )) s  ($*)"
  [ "$rc" -eq 124 ] && line="$line  TIMED OUT after ${limit} s"
  echo "$line" | tee -a "$SUMMARY"
  tail -n 4 "$OUT_DIR/$name.log" | sed 's/^/    /' | tee -a "$SUMMARY"
  [ "$rc" -eq 0 ] || failed=1
}

nvidia-smi > "$OUT_DIR/nvidia-smi.txt" 2>&1 || true
step probe 60 "$PY" -c "
import cupy, torch, minivit
print('cupy', cupy.__version__, 'available', cupy.cuda.is_available(), 'torch', torch.__version__,
      'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')
print('minivit sees a GPU:', minivit.gpu_available())"

step suite_on_cupy 300 "$PY" -m pytest -q -p no:cacheprovider --backend cupy tests/
step gpu_and_fast_paths 120 "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_fast_paths.py
step bench_tf32_off 240 env CUPY_TF32=0 "$PY" benchmarks/bench.py --device gpu --full --out "$OUT_DIR"
step bench_tf32_on 180 env CUPY_TF32=1 "$PY" benchmarks/bench.py --device gpu --full --no-profile --out "$OUT_DIR"
step bench_fp16 150 env CUPY_TF32=1 "$PY" benchmarks/bench.py --device gpu --full --no-sweep --no-profile --precision float16 --out "$OUT_DIR"
step profile_cupy 60 "$PY" benchmarks/profile_layers.py --backend cupy --batch 128 --repeats 5

echo "---- benchmark tables (TF32 off, TF32 on, mixed float16) ----" | tee -a "$SUMMARY"
for f in bench_tf32_off bench_tf32_on bench_fp16; do
  sed -n '/^| model/,/^$/p' "$OUT_DIR/$f.log" | tee -a "$SUMMARY"
done
echo "all logs and JSON in $OUT_DIR; failed=$failed" | tee -a "$SUMMARY"
exit "$failed"
