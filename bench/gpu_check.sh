#!/usr/bin/env bash
# The GPU checks, in one go, for a machine with CUDA and the image's python3 (torch, triton, transformers,
# peft): the LoRA kernel benchmark, then the Triton kernel tests and the engine's parity tests on CUDA.
# Usage: bash bench/gpu_check.sh [OUT_DIR] [all|bench|tests]
OUT="${1:-${OUT:-/tmp/gpu_check}}"
WHAT="${2:-all}"
mkdir -p "$OUT"
# Packages the GPU image lacks (pydantic for loraplex.config, pytest-asyncio), carried as wheels in .whl/
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/gpu.txt"
if [ "$WHAT" != tests ]; then
timeout 240 python3 bench/bench_lora_kernels.py --dtype bfloat16 ${SWEEP:+--sweep} --out "$OUT/lora_kernels_bfloat16.md" 2>&1 | tail -40
timeout 60 python3 bench/bench_lora_kernels.py --dtype float16 --quick --out "$OUT/lora_kernels_float16.md" 2>&1 | tail -12
fi
[ "$WHAT" = bench ] && exit 0
timeout 90 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_lora_triton.py \
  tests/kernels/test_lora_torch.py 2>&1 | tee "$OUT/kernel_tests.log" | tail -15
# the engine's tests on CUDA (device "auto" picks the GPU), against transformers/PEFT references;
# GGUF conversion is CPU-only and needs the gguf package
timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m "not slow" tests/engine \
  --ignore=tests/engine/test_gguf.py 2>&1 | tee "$OUT/engine_tests.log" | tail -40
