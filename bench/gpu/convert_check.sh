#!/bin/bash
# The MPI + CuPy nccl engine on ONE GPU, 4 ranks on GPU 0 (each its own NCCL host: NCCL_HOSTID, sockets), converting
# at the sender (fp16, bf16, FP8 with block and per-tensor scales, device and posted order, a one-tensor bf16 cast)
# and receiving into views of the caller's CUDA tensors (rows, columns, every other element), every element bit for
# bit against torch's own casts (bench/gpu/convert_check.py). Prints `convert_check: bit-exact ok (52 checks on 4
# ranks)` or `convert_check: FAILED ...` with the failing lines. Needs what check.sh carries (.whl, its header) and
# takes well under 3 minutes; bash bench/gpu/check.sh runs it as its section `convert`. The log is $OUT/convert.log.
set -u
cd "$(dirname "$0")/../.."
exec > >(tee "${OUT:-/tmp}/convert.log") 2>&1
source bench/gpu/setup.sh
EXPECTED=$(python3 bench/gpu/convert_check.py --expected 4)  # per rank: 2 runs of each check, and an into run after some
echo "=== nccl engine: conversion at the sender and into= (4 ranks on GPU 0)"
rm -rf /tmp/xmesh-convert-plans /tmp/xmesh-convert.log
MPIR_CVAR_ENABLE_HEAVY_YIELD=1 timeout 170 "$BIN/mpiexec" -n 4 python3 bench/gpu/convert_check.py /tmp/xmesh-convert-plans \
  > /tmp/xmesh-convert.log 2>&1
rc=$?
grep "^rank [0-9]*: " /tmp/xmesh-convert.log | sort
ok=$(grep -c "^rank [0-9]*: .*: ok$" /tmp/xmesh-convert.log)
if [ "$rc" = 0 ] && [ "$ok" = "$EXPECTED" ]; then
  echo "convert_check: bit-exact ok ($ok checks on 4 ranks)"
else
  echo "convert_check: FAILED (rc=$rc, $ok of $EXPECTED checks ok); the rest of the log:"
  grep -v "^rank [0-9]*: .*: ok$" /tmp/xmesh-convert.log | tail -40
fi
