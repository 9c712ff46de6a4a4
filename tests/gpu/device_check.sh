#!/usr/bin/env bash
# The GPU checks of the runtime, as one prepared run on a machine with CUDA (the device tool):
# the tests marked gpu, with their output. It needs python3 with torch, psutil, pytest and
# scikit-learn there; phalanx itself runs from this checkout's src/.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src:$PWD" PYTHONUNBUFFERED=1
log="${OUT:-.}/gpu-checks.log"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
  python3 -m pytest -q -s -m gpu tests/gpu -p no:cacheprovider
} 2>&1 | tee "$log"
