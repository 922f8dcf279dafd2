"""Whether this machine can run the real-GPU tests: CuPy installed and a CUDA device it sees (`GPU_REASON`: None, or
why not, the reason a skipped test gives)."""

from __future__ import annotations


def gpu_reason() -> str | None:
    try:
        import cupy
    except ImportError:
        return "cupy is not installed (pip install cupy-cuda12x to run the NCCL backend tests)"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as err:
        return f"CuPy finds no CUDA device ({err})"
    return None if count else "CuPy finds no CUDA device"


GPU_REASON = gpu_reason()
