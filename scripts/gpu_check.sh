#!/usr/bin/env bash
# One-shot GPU check, run on the GPU machine (H100, torch 2.11 + CUDA 13, no
# network) as:  bash scripts/gpu_check.sh OUTDIR
# Builds collx there with its CUDA kernels, runs the kernel tests (CPU and
# CUDA twins), the kernel benchmark, the CUDA-tensor tests (2 and 4 ranks on
# one GPU), and the all-reduce benchmark on CUDA and on CPU tensors, collx
# beside gloo (and on CUDA with reductions on the host). Writes summary.txt and
# gpu_check.tar.gz (logs, JSON, figures) into OUTDIR (about 6 minutes).
set -uo pipefail
OUT=${1:?usage: gpu_check.sh OUTDIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 PYTHONPATH=$PWD
# The device tool returns at most 8 files: everything is written to W, and
# OUTDIR gets summary.txt plus all of W as gpu_check.tar.gz, packed after
# every step, so a run cut short still returns what it did.
W=$(mktemp -d)
pack() { cp "$W/summary.txt" "$OUT/" 2>/dev/null; tar czf "$OUT/gpu_check.tar.gz" -C "$W" .; }
trap pack EXIT
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  start=$(date +%s)
  $PY setup.py build_ext --inplace > "$W/build.log" 2>&1 || { echo "BUILD FAILED"; tail -30 "$W/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - start )) s"
  $PY -c "import torchcollx; print('cuda_kernels', torchcollx._C.cuda_kernels)"
} 2>&1 | tee "$W/summary.txt"
[ "${PIPESTATUS[0]}" = 0 ] || exit 1

run() {  # name, timeout, command...: a failure's last lines go into the summary too
  local name=$1 limit=$2 rc; shift 2
  echo "== $name" | tee -a "$W/summary.txt"
  timeout "$limit" "$@" > "$W/$name.txt" 2>&1
  rc=$?
  echo "rc=$rc $(tail -1 "$W/$name.txt")" | tee -a "$W/summary.txt"
  [ $rc = 0 ] || tail -60 "$W/$name.txt" >> "$W/summary.txt"
  pack
}
run test_kernels 120 $PY -m pytest tests/test_kernels.py -q -p no:cacheprovider
run bench_kernels 120 $PY benchmarks/kernels.py --mb 256
run test_cuda 300 $PY -m pytest tests/test_cuda.py -q -p no:cacheprovider
# Issue 4's targets: CUDA tensors vs gloo on the same CUDA tensors, and vs
# collx's own CPU-tensor busbw on this machine; 4 ranks share cuda:0.
bench() {  # name, device, sizes
  run "$1" 150 $PY -m torch.distributed.run --nproc_per_node=4 benchmarks/allreduce.py --device "$2" \
    --algos ring,auto --sizes "$3" --time-per-point 0.3 --no-loopback --plot "$W/$1.png" \
    --json "$W/$1.json"
}
bench bench_allreduce_cuda_n4 cuda 4,64K,1M,16M,64M
bench bench_allreduce_cpu_n4 cpu 4,64K,1M,16M,64M
# The same CUDA tensors with every reduction on the host, to tune
# COLLX_DEVICE_REDUCE_MIN_BYTES: 4 ranks share one GPU's PCIe link, and a
# reduction on the GPU moves 2 buffers across it where the host moves none.
COLLX_DEVICE_REDUCE_MIN_BYTES=off bench bench_allreduce_cuda_n4_host_reduce cuda 1M,16M,64M
cat "$W"/bench_kernels.txt "$W"/bench_allreduce_*.txt >> "$W/summary.txt"
