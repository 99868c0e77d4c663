#!/usr/bin/env bash
# GPU check (issue 30), under 8 minutes: tools/device/gpu_check.sh LOGDIR
# Needs the venv (make setup) plus the gpu extra (onnxruntime-gpu, TensorRT, cuda-python) on a GPU machine;
# what is missing is logged as a failed step, not a crash. See tools/device/gpu_check.py.
set -uo pipefail
if [ $# -ne 1 ]; then echo "usage: $0 LOGDIR" >&2; exit 2; fi
LOGDIR=$1
mkdir -p "$LOGDIR"
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-$HERE/../../.venv/bin/python}
nvidia-smi > "$LOGDIR/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed: no NVIDIA GPU?" | tee -a "$LOGDIR/gpu_check.log"
"$PYTHON" -c "import tensorrt, onnxruntime; print('tensorrt', tensorrt.__version__, 'onnxruntime', onnxruntime.__version__, onnxruntime.get_available_providers())" \
  >> "$LOGDIR/gpu_check.log" 2>&1
"$PYTHON" -c "from cuda.bindings import runtime; print('cuda-python runtime bindings, driver', runtime.cudaDriverGetVersion())" \
  >> "$LOGDIR/gpu_check.log" 2>&1
timeout 470 "$PYTHON" "$HERE/gpu_check.py" "$LOGDIR" 2>&1 | tee -a "$LOGDIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
