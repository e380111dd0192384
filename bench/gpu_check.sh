#!/usr/bin/env bash
# Every GPU check and benchmark in one run, for a lent GPU machine (the `device` tool) or any
# CUDA box: GPU tests, the ViT benchmark (eager fp16/bf16 vs graph pool vs TensorRT when it
# imports), and the end-to-end QPM benchmark on CUDA. Writes a short report to $OUT (or ./out).
# Budget: about 5 minutes on an H200; nothing is downloaded.
#
#   bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
{
  echo "== $(date -u) $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1)"
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
  echo "== GPU tests (pytest -m gpu)"
  timeout 240 python -m pytest -q -m gpu -rs -p no:cacheprovider tests 2>&1 | tail -15
  echo "== ViT benchmark (InternViT-300M shape, tiles/s)"
  timeout 240 python bench/vit.py --device cuda --encoders 300m --reps 10 2>&1 | tail -20
  echo "== W4A16 vs bf16 linears (Qwen2-0.5B layer shapes, CPU side of the same script)"
  timeout 120 python bench/quant.py --linears-only --rounds 2 2>&1 | tail -8
} 2>&1 | tee "$out/gpu_check.txt"
