#!/bin/bash
# The executor's GPU paths on ONE GPU, every rank on GPU 0 (NCCL over sockets, NCCL_HOSTID per rank): the real-GPU
# tests, the MPI + CuPy nccl engine and the torch engine over NCCL on four plans (--check), the DTensor front end
# on CUDA tensors, and WeightSync over NCCL (the demo, plain and converting, and two launches joined by
# transfer_group). It passed on one H200 (docs/executor.md, "GPU", names the commits); its timings mean nothing (eight ranks share one
# GPU over sockets), so none are kept.
#
# Prepare here (pip works here, not there), in the repo root:
#   echo /.whl/ >> .git/info/exclude; P="--only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
#   .venv/bin/python -m pip download --no-deps $P -d .whl pydantic pydantic_core typing-inspection annotated-types \
#     mpich mpi4py ortools immutabledict protobuf      # the versions .venv has; the image lacks these
#   PYTHONPATH=$PWD .venv/bin/python bench/gpu/make_plans.py .whl/plans
#   mkdir -p .whl/moe && .venv/bin/xmesh-plan compile plans/weight_sync_deepseek_v3_48.problem.toml -o .whl/moe/moe48.plan.json
# Then run `bash bench/gpu/check.sh [SECTION ...]` there with `.whl` carried (sections: moe (with moe_torch) convert demo separate dtensor torch
# cupy pytest, all by default); the log is $OUT/gpu.log. `convert` is bench/gpu/convert_check.sh (the MPI + CuPy nccl
# engine converting at the sender and receiving into views of CUDA tensors), which also runs on its own.
set -u
cd "$(dirname "$0")/../.."
exec > >(tee "${OUT:-/tmp}/gpu.log") 2>&1
source bench/gpu/setup.sh  # the repo's xmesh_plan/ made the whole package, the wheels, PYTHONPATH, BIN
nvidia-smi -L
ranks() { python3 -c "import sys; from xmesh_plan.schemas.plan import read_plan_file; from xmesh_plan.executor.ranks import plan_devices; print(len(plan_devices(read_plan_file(sys.argv[1]))))" "$1"; }
fake_host() { echo "NCCL_HOSTID=xmesh-rank-$1 NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket"; }

launch() {  # launch N ranks of a python command line on cuda:0, each its own NCCL host; prints rank 0's tail, or every rank's on failure
  local n=$1 port=$2; shift 2; local pids=() rc=0
  rm -f /tmp/rank-*.log
  for r in $(seq 0 $((n - 1))); do
    env $(fake_host "$r") RANK=$r WORLD_SIZE=$n LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout "${RANK_TIMEOUT:-200}" "$@" > "/tmp/rank-$r.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
  if [ "$rc" = 0 ]; then grep -h "check ok\|CHECK FAILED\|^rank [0-9]*: \(ok\|counts\)" /tmp/rank-*.log; tail -n 3 /tmp/rank-0.log; else tail -n 6 /tmp/rank-*.log; fi
  echo "rc=$rc"
}
section_demo() {
  echo "=== WeightSync demo over NCCL: FSDP2 trainer on 4 ranks -> 2 TP=2 replicas, received in place into the engine's CUDA tensors, then fused FP8/fp16/bf16 (at ${SECONDS} s)"
  launch 8 29800 python3 -m xmesh_plan.weight_sync_demo --device cuda
  grep -h "step\|synced\|FAILED\|Error" /tmp/rank-*.log | sort | uniq -c | sort -rn | head -20
}
section_separate() {
  echo "=== WeightSync across two launches of 4 ranks (trainer, inference) joined by transfer_group over NCCL (at ${SECONDS} s)"
  local pids=() rc=0 side r t
  rm -f /tmp/rank-*.log
  for side in trainer inference; do
    for r in 0 1 2 3; do
      t=$r; [ "$side" = inference ] && t=$((r + 4))
      env $(fake_host "$t") XMESH_WORKER_DEVICE=cuda TRANSFER_PORT=29900 RANK=$r WORLD_SIZE=4 LOCAL_RANK=0 \
        MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29901 + t / 4)) timeout 200 python3 tests/workers/weight_sync_worker.py "$side" \
        > "/tmp/rank-$t.log" 2>&1 &
      pids+=($!)
    done
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
  for t in 0 1 2 3 4 5 6 7; do  # transfer rank t's results (its launch's rank first), and the cause of any failure
    grep -h "^rank [0-9]*: \|Error\|what()" "/tmp/rank-$t.log" | grep -v "^frame\|Warning" | sed "s/^/transfer rank $t: /"
  done
  echo "rc=$rc"
}
section_dtensor() {
  echo "=== DTensor front end (redistribute) on CUDA tensors over NCCL (at ${SECONDS} s)"
  for seed in 0 1; do
    echo "--- seed $seed, 4 ranks"
    launch 4 $((29700 + seed)) env XMESH_WORKER_DEVICE=cuda python3 tests/workers/redistribute_worker.py "$seed"
  done
}
section_torch() {
  echo "=== torch engine over NCCL (at ${SECONDS} s)"
  port=29600
  for p in .whl/plans/*.plan.json; do
    n=$(ranks "$p"); port=$((port + 1)); echo "--- $p ($n ranks)"
    launch "$n" "$port" python3 -m xmesh_plan.executor.torch_run "$p" --nccl --check --max-mb 4 --iters 3 --timeout 30
  done
}
section_cupy() {
  echo "=== MPI + CuPy nccl engine (--fake-hosts) (at ${SECONDS} s)"
  for p in .whl/plans/*.plan.json; do
    n=$(ranks "$p"); echo "--- $p ($n ranks)"
    MPIR_CVAR_ENABLE_HEAVY_YIELD=1 timeout 120 "$BIN/mpiexec" -n "$n" python3 -m xmesh_plan.executor.run "$p" --backend nccl \
      --check --gpu 0 --fake-hosts --max-mb 4 --iters 3 2>&1 | tail -3
  done
}
section_moe() {
  echo "=== the 48-device MoE plan (plans/weight_sync_deepseek_v3_48) on the MPI + CuPy nccl engine, 48 ranks on GPU 0 (at ${SECONDS} s)"
  MPIR_CVAR_ENABLE_HEAVY_YIELD=1 timeout 240 "$BIN/mpiexec" -n 48 python3 -m xmesh_plan.executor.run .whl/moe/moe48.plan.json \
    --backend nccl --check --gpu 0 --fake-hosts --max-mb 4 --iters 3 --timeout 120 2>&1 | tail -4
  echo "rc=${PIPESTATUS[0]}"
  section_moe_torch
}
section_moe_torch() {  # 48 ranks' sockets on one GPU: about 30 s an iteration, so each rank gets 420 s
  echo "--- the 48-device MoE plan on the torch engine over NCCL, 48 ranks (at ${SECONDS} s)"
  RANK_TIMEOUT=420 launch 48 29850 python3 -m xmesh_plan.executor.torch_run .whl/moe/moe48.plan.json --nccl --check --max-mb 4 --iters 3 --timeout 60
}
section_convert() {
  echo "=== bench/gpu/convert_check.sh (at ${SECONDS} s)"
  bash bench/gpu/convert_check.sh
}
section_pytest() {
  echo "=== pytest -m gpu tests/test_executor_gpu.py tests/test_executor_gpu_convert.py tests/test_convert_torch.py (at ${SECONDS} s)"
  timeout 300 python3 -m pytest -p no:cacheprovider -m gpu tests/test_executor_gpu.py tests/test_executor_gpu_convert.py tests/test_convert_torch.py -rA 2>&1 | tail -8
}
# the sections named on the command line, else all of them, the newest paths first (a run cut short by its time limit
# still says the most): moe convert demo separate dtensor torch cupy pytest
for section in ${@:-moe convert demo separate dtensor torch cupy pytest}; do "section_$section"; done
echo "=== done in ${SECONDS} s"
