#!/usr/bin/env bash
# One-shot GPU check, run on the GPU machine (H100, torch 2.11 + CUDA 13, no
# network) as:  bash scripts/gpu_check.sh OUTDIR
# Builds collx there with its CUDA kernels, runs every CUDA test (kernels,
# collectives and DDP at 2 and 4 ranks on one GPU), the kernel benchmark, the
# CUDA call costs, and the all-reduce benchmark on CUDA and on CPU
# tensors, collx beside gloo, at 2 and 4 ranks. Writes summary.txt and
# gpu_check.tar.gz (logs, JSON, figures) into OUTDIR. STEPS, a comma list of
# tests, kernels, costs, allreduce, peers, variants, staging, mps, wheel (default: all), runs a part.
# scripts/cuda_table.py turns the peers step's JSON into docs/cuda.md's table.
# On an H200 (2026-11-27/28): build 35-48 s, tests ~75 s, allreduce ~100 s, peers
# ~130 s, staging ~110 s, mps ~50 s; all of them outrun one device call (600 s),
# so pick steps.
set -uo pipefail
OUT=${1:?usage: gpu_check.sh OUTDIR [STEPS]}
STEPS=${2:-all}
want() { [ "$STEPS" = all ] || [[ ",$STEPS," == *",$1,"* ]]; }
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
# Every CUDA test, one pytest worker per file (a file's cases share their rank
# launches): the kernels, the collectives at 2 and 4 ranks on cuda:0, the DDP
# hook's CUDA buckets at 2 and 4 ranks, abort and shrink with CUDA ops in
# flight, a profiler trace of a staged op, a rank with no memory for its peer
# buffer. -rs lists skips: here a skip is a failure.
# The gpu_alone tests fill the GPU, so they run after the others, alone.
want tests && run tests 300 $PY -m pytest -q -rs -p no:cacheprovider -n 3 --dist loadfile -m "not gpu_alone" \
  tests/test_kernels.py tests/test_cuda.py tests/test_cuda_faults.py tests/test_ddp_hook.py::test_ddp_comm_hook_cuda \
  tests/test_groups.py::test_split_group
want tests && run tests_alone 120 $PY -m pytest -q -rs -p no:cacheprovider -m gpu_alone tests/test_cuda_faults.py
want kernels && run bench_kernels 120 $PY benchmarks/kernels.py --mb 256
# The floor of a staged op: each CUDA call it makes, and a one-rank group.
want costs && run bench_cuda_costs 60 $PY benchmarks/cuda_costs.py
# Issue 13's targets: CUDA tensors vs gloo on the same CUDA tensors, and vs
# collx's own CPU-tensor busbw on this machine; the ranks share cuda:0.
VARS=""  # VAR=value words for the benchmark's environment
bench() {  # name, ranks, device, sizes, [more benchmark arguments]
  run "$1" 150 env $VARS $PY -m torch.distributed.run --nproc_per_node=$2 benchmarks/allreduce.py --device "$3" \
    --algos auto --sizes "$4" --time-per-point 0.3 --no-loopback --plot "$W/$1.png" --json "$W/$1.json" "${@:5}"
}
# The staging's pipeline chunk, collx alone on CUDA tensors (host reductions,
# the default): ranks time-sharing one GPU pay for every wait on a copy, so
# fewer, larger chunks may win where the CPU op is fast (shared memory).
variant() {  # ranks, name, VAR=value...
  local n=$1 name=$2; shift 2
  VARS="$*" bench "bench_var_n${n}_$name" "$n" cuda 4M,16M,64M --backends collx --time-per-point 0.2
}
for n in 2 4; do
  want allreduce && bench bench_allreduce_cuda_n$n $n cuda 4K,64K,1M,16M,64M --transports shm,tcp
  want allreduce && bench bench_allreduce_cpu_n$n $n cpu 4K,64K,1M,16M,64M --transports shm,tcp
  # auto's all-reduce through the ranks' device buffers at every size, beside
  # gloo, staging on the host, and CPU tensors: where the two paths cross.
  if want peers; then
    sizes=4K,64K,256K,1M,4M,16M,64M
    VARS=COLLX_PEER_MIN_BYTES=0 bench bench_peers_cuda_n$n $n cuda $sizes --transports shm --time-per-point 0.2
    VARS=COLLX_PEER_BUFFER_BYTES=off bench bench_staged_cuda_n$n $n cuda $sizes --transports shm --backends collx \
      --time-per-point 0.2
    bench bench_peers_cpu_n$n $n cpu $sizes --transports shm --backends collx --time-per-point 0.2
  fi
  if want variants; then
    bench "bench_var_n${n}_cpu" "$n" cpu 4M,16M,64M --backends collx --time-per-point 0.2  # the floor
    for chunk in 4194304 8388608 16777216 off; do variant $n chunk_$chunk COLLX_STAGING_CHUNK_BYTES=$chunk; done
  fi
done
# Where a staged all-reduce's time goes: CUDA tensors under several staging
# settings beside pageable and pinned CPU tensors and the copies alone.
if want staging; then
  for n in 2 4; do
    run staging_n$n 120 $PY -m torch.distributed.run --nproc_per_node=$n benchmarks/staging.py
  done
fi
# The same CUDA-tensor all-reduce with the ranks' GPU work under MPS (one shared
# context, no time-slicing between the ranks' processes): what the staging
# costs when the ranks do not take turns on the GPU, as with a GPU per rank.
if want mps; then
  if command -v nvidia-cuda-mps-control > /dev/null; then
    (
      export CUDA_MPS_PIPE_DIRECTORY=$W/mps_pipe CUDA_MPS_LOG_DIRECTORY=$W/mps_log
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
      nvidia-cuda-mps-control -d
      if timeout 60 $PY -c "import torch; torch.ones(1, device='cuda').sum().item()"; then
        echo "mps: on, servers: $(echo get_server_list | nvidia-cuda-mps-control | tr '\n' ' ')" | tee -a "$W/summary.txt"
        for n in 2 4; do
          bench bench_mps_cuda_n$n $n cuda 4K,64K,1M,16M,64M --transports shm,tcp
        done
      else
        echo "mps: a CUDA context failed under MPS, step skipped" | tee -a "$W/summary.txt"
      fi
      echo quit | nvidia-cuda-mps-control
    )
  else
    echo "mps: nvidia-cuda-mps-control not found, step skipped" | tee -a "$W/summary.txt"
  fi
fi
# The installed wheel on the GPU (issue 72): built here with the kernels, put
# in a venv that sees the machine's torch (no network to install one) but not
# this tree, and used with no import: a 2-rank CUDA all-reduce on cuda:0.
if want wheel; then
  run wheel_build 300 $PY -m pip wheel -q --no-build-isolation --no-deps -w "$W/dist" .
  $PY -m venv --system-site-packages "$W/venv" && "$W/venv/bin/pip" install -q --no-deps "$W"/dist/torchcollx-*.whl
  cat > "$W/wheel_cuda.py" <<'PYEOF'
import sys, torch, torch.distributed as dist
dist.init_process_group("collx")
t = torch.full((1 << 20,), float(dist.get_rank() + 1), device="cuda:0")
dist.all_reduce(t)
ok = bool((t == 3.0).all())
print(f"rank {dist.get_rank()}: {dist.get_backend()} from {sys.modules['torchcollx'].__file__}, all_reduce ok {ok}")
dist.destroy_process_group()
sys.exit(0 if ok else 1)
PYEOF
  (cd "$W" && env -u PYTHONPATH timeout 120 "$W/venv/bin/python" -m torch.distributed.run --nproc_per_node=2 \
     wheel_cuda.py > "$W/wheel_cuda.txt" 2>&1; echo "== wheel_cuda rc=$? $(grep -c 'all_reduce ok True' wheel_cuda.txt) of 2 ranks ok") \
    | tee -a "$W/summary.txt"
  pack
fi
cat "$W"/bench_*.txt "$W"/staging_*.txt >> "$W/summary.txt" 2>/dev/null
