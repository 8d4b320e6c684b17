#!/usr/bin/env bash
# The GPU checks, in one go, for a machine with CUDA and the image's python3 (torch, triton, transformers,
# peft): the LoRA kernel benchmark, then the Triton kernel tests and the engine's parity tests on CUDA.
# Usage: bash bench/gpu_check.sh [OUT_DIR]
OUT="${1:-${OUT:-/tmp/gpu_check}}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/gpu.txt"
timeout 180 python3 bench/bench_lora_kernels.py --dtype bfloat16 --out "$OUT/lora_kernels_bfloat16.md" 2>&1 | tail -40
timeout 60 python3 bench/bench_lora_kernels.py --dtype float16 --quick --out "$OUT/lora_kernels_float16.md" 2>&1 | tail -12
timeout 90 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_lora_triton.py \
  tests/kernels/test_lora_torch.py 2>&1 | tee "$OUT/kernel_tests.log" | tail -15
timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m "not slow" \
  tests/engine/test_model_parity.py tests/engine/test_lora_peft.py tests/engine/test_consistency.py \
  tests/engine/test_lora_engine.py tests/engine/test_bad_input.py 2>&1 | tee "$OUT/engine_tests.log" | tail -40
