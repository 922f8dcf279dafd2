#!/bin/bash
# The executor's GPU paths on ONE GPU, every rank on GPU 0 (NCCL over sockets, NCCL_HOSTID per rank): the real-GPU
# tests, the MPI + CuPy nccl engine and the torch engine over NCCL on four plans (--check), and the DTensor front end
# on CUDA tensors. It passes on one H200 (docs/executor.md, "GPU"); its timings mean nothing (eight ranks share one
# GPU over sockets), so none are kept.
#
# Prepare here (pip works here, not there), in the repo root:
#   echo /.whl/ >> .git/info/exclude; P="--only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
#   .venv/bin/python -m pip download --no-deps $P -d .whl pydantic pydantic_core typing-inspection annotated-types \
#     mpich mpi4py ortools immutabledict protobuf      # the versions .venv has; the image lacks these
#   PYTHONPATH=$PWD .venv/bin/python bench/gpu/make_plans.py .whl/plans
# Then run `bash bench/gpu/check.sh` there with `.whl` carried; the log is $OUT/gpu.log. Its last part,
# bench/gpu/convert_check.sh (the nccl engine converting at the sender and receiving into the caller's tensors),
# also runs on its own the same way.
set -u
cd "$(dirname "$0")/../.."
exec > >(tee "${OUT:-/tmp}/gpu.log") 2>&1
source bench/gpu/setup.sh
nvidia-smi -L
ranks() { python3 -c "import sys; from xmesh_plan.schemas.plan import read_plan_file; from xmesh_plan.executor.ranks import plan_devices; print(len(plan_devices(read_plan_file(sys.argv[1]))))" "$1"; }
fake_host() { echo "NCCL_HOSTID=xmesh-rank-$1 NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket"; }

echo "=== pytest -m gpu tests/test_executor_gpu.py"
timeout 300 python3 -m pytest -p no:cacheprovider -m gpu tests/test_executor_gpu.py -rA 2>&1 | tail -8
echo "=== MPI + CuPy nccl engine (--fake-hosts)"
for p in .whl/plans/*.plan.json; do
  n=$(ranks "$p"); echo "--- $p ($n ranks)"
  MPIR_CVAR_ENABLE_HEAVY_YIELD=1 timeout 120 "$BIN/mpiexec" -n "$n" python3 -m xmesh_plan.executor.run "$p" --backend nccl \
    --check --gpu 0 --fake-hosts --max-mb 4 --iters 3 2>&1 | tail -3
done
launch() {  # launch N ranks of a python command line on cuda:0, each its own NCCL host; prints rank 0's tail, or every rank's on failure
  local n=$1 port=$2; shift 2; local pids=() rc=0
  rm -f /tmp/rank-*.log
  for r in $(seq 0 $((n - 1))); do
    env $(fake_host "$r") RANK=$r WORLD_SIZE=$n LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 200 "$@" > "/tmp/rank-$r.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
  if [ "$rc" = 0 ]; then grep -h "check ok\|CHECK FAILED\|^rank [0-9]*: \(ok\|counts\)" /tmp/rank-*.log; else tail -n 6 /tmp/rank-*.log; fi
  echo "rc=$rc"
}
echo "=== torch engine over NCCL"
port=29600
for p in .whl/plans/*.plan.json; do
  n=$(ranks "$p"); port=$((port + 1)); echo "--- $p ($n ranks)"
  launch "$n" "$port" python3 -m xmesh_plan.executor.torch_run "$p" --nccl --check --max-mb 4 --iters 3 --timeout 30
done
echo "=== DTensor front end (redistribute) on CUDA tensors over NCCL"
for seed in 0 1; do
  echo "--- seed $seed, 4 ranks"
  launch 4 $((29700 + seed)) env XMESH_WORKER_DEVICE=cuda python3 tests/workers/redistribute_worker.py "$seed"
done
bash bench/gpu/convert_check.sh
