# Sourced by bench/gpu/check.sh and bench/gpu/convert_check.sh from the repo root on the GPU machine (once per shell):
# makes the repo's xmesh_plan/ the whole package, installs the carried wheels (.whl, see check.sh's header), sets
# PYTHONPATH and BIN (the folder of python3, where the mpich wheel's mpiexec is).
if [ -z "${XMESH_GPU_SETUP:-}" ]; then
  # from the repo root the repo's xmesh_plan/ (front ends only) comes first on sys.path: make it the whole package
  for d in planner executor schemas; do ln -sfn ../$d xmesh_plan/$d; done
  mkdir -p xmesh_plan/examples_data && ln -sfn ../../plans xmesh_plan/examples_data/plans && ln -sfn ../../bench/pipelines xmesh_plan/examples_data/pipelines
  python3 -m pip install -q --no-index --no-deps --no-cache-dir .whl/*.whl 2>&1 | grep -v "dependency conflicts\|requires\|^$" | tail -3
  export XMESH_GPU_SETUP=1
fi
export PYTHONPATH=$PWD
BIN=$(dirname "$(python3 -c 'import sys; print(sys.executable)')")
