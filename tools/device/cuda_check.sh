#!/usr/bin/env bash
# CUDA check (issue 43 item 5), under 5 minutes: tools/device/cuda_check.sh LOGDIR [--bundle B | --host-memory ...]
# The TensorRT backend's CUDA side (CudaDevice, DeviceKVCache) on a real GPU, each engine its graph on ONNX Runtime CPU.
# Needs the venv (make setup) plus cuda-python (pip install 'cuda-python>=12.8,<13'); no TensorRT, no onnxruntime-gpu.
# Exit 0: every check held; 1: one did not; 2: no cuda-python runtime bindings or no GPU. See tools/device/cuda_check.py.
set -uo pipefail
if [ $# -lt 1 ]; then echo "usage: $0 LOGDIR [cuda_check.py options]" >&2; exit 2; fi
mkdir -p "$1"
LOGDIR=$(cd "$1" && pwd)
shift
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../.."  # the export (python -m edgeroute.cli) runs this checkout's edgeroute
PYTHON=${PYTHON:-$HERE/../../.venv/bin/python}
nvidia-smi > "$LOGDIR/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed: no NVIDIA GPU?" | tee -a "$LOGDIR/cuda_check.log"
timeout 300 "$PYTHON" "$HERE/cuda_check.py" "$LOGDIR" "$@" 2>&1 | tee -a "$LOGDIR/cuda_check.log"
exit "${PIPESTATUS[0]}"
