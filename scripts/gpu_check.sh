#!/usr/bin/env bash
# One-shot GPU check, run on the GPU machine (H100, torch 2.11 + CUDA 13, no
# network) as:  bash scripts/gpu_check.sh OUTDIR
# Builds collx there with its CUDA kernels, runs the kernel tests (CPU and
# CUDA twins), the kernel benchmark, the CUDA-tensor tests (2 and 4 ranks on
# one GPU), and the all-reduce benchmark on CUDA and on CPU tensors, collx
# beside gloo (and on CUDA with reductions on the host). Writes logs, JSON and
# figures into OUTDIR (about 6 minutes).
set -uo pipefail
OUT=${1:?usage: gpu_check.sh OUTDIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 PYTHONPATH=$PWD
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  start=$(date +%s)
  $PY setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { echo "BUILD FAILED"; tail -30 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - start )) s"
  $PY -c "import torchcollx; print('cuda_kernels', torchcollx._C.cuda_kernels)"
} 2>&1 | tee "$OUT/summary.txt"
[ "${PIPESTATUS[0]}" = 0 ] || exit 1

run() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  echo "== $name" | tee -a "$OUT/summary.txt"
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "rc=$? $(tail -1 "$OUT/$name.txt")" | tee -a "$OUT/summary.txt"
}
run test_kernels 120 $PY -m pytest tests/test_kernels.py -q -p no:cacheprovider
run bench_kernels 120 $PY benchmarks/kernels.py --mb 256
run test_cuda 300 $PY -m pytest tests/test_cuda.py -q -p no:cacheprovider
# Issue 4's targets: CUDA tensors vs gloo on the same CUDA tensors, and vs
# collx's own CPU-tensor busbw on this machine; 4 ranks share cuda:0.
bench() {  # name, device, sizes
  run "$1" 150 $PY -m torch.distributed.run --nproc_per_node=4 benchmarks/allreduce.py --device "$2" \
    --algos ring,auto --sizes "$3" --time-per-point 0.3 --no-loopback --plot "$OUT/$1.png" \
    --json "$OUT/$1.json"
}
bench bench_allreduce_cuda_n4 cuda 4,64K,1M,16M,64M
bench bench_allreduce_cpu_n4 cpu 4,64K,1M,16M,64M
# The same CUDA tensors with every reduction on the host, to tune
# COLLX_DEVICE_REDUCE_MIN_BYTES: 4 ranks share one GPU's PCIe link, and a
# reduction on the GPU moves 2 buffers across it where the host moves none.
COLLX_DEVICE_REDUCE_MIN_BYTES=off bench bench_allreduce_cuda_n4_host_reduce cuda 1M,16M,64M
cat "$OUT"/bench_kernels.txt "$OUT"/bench_allreduce_*.txt >> "$OUT/summary.txt"
