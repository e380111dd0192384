#!/usr/bin/env bash
# Every GPU check and benchmark in one run, for a lent GPU machine (the `device` tool) or any
# CUDA box. Nothing is downloaded: on the lent machine first run bench/gpu_wheels.sh here and
# carry .whl (see that script). Steps, each under its own time limit:
#   1. the GPU tests (pytest -m gpu): graph pool vs eager and the race guard, the whole engine
#      on CUDA vs the CPU (fp32 with and without graphs, bf16, prefix cache, the CLI), the
#      int4 tinygemm kernel, AWQ/GPTQ calibration and serving on CUDA, FP8 _scaled_mm vs its
#      reference (quant/fp8.py), TensorRT (skipped where tensorrt is not installed);
#   2. bench/vit.py: eager fp16/bf16 vs graph pool (vs TensorRT when it imports), batch 1..32,
#      the built-in encoder and the InternViT-300M shape;
#   3. bench/qpm.py on CUDA, bf16: batched and per-question transformers vs vlmbatch rows,
#      with FLOPs per question and the fraction of 790 TFLOP/s;
#   4. bench/quant.py --linears-only on CUDA: fp32 vs bf16 vs W4A16 (tinygemm) linears;
#   5. bench/attention.py on CUDA: SDPA enable_gqa vs K/V expanded per head (enable_gqa won on
#      the H200, so models/decoder.py never expands);
#   6. vlmbatch eval on CUDA, bf16: the built-in model's easy-vqa accuracy (CPU fp32: 0.9985);
#   7. bench/prefetch.py on CUDA: `run` with 0, 2, 8 and 16 preprocessing threads preparing
#      the next groups while the GPU answers;
#   8. bench/qpm.py again on a random-weight model of InternVL3-1B's shape: speed at real size,
#      with the fp8 row (W8A8 e4m3 linears) and the compiled-prefill row (--compile-llm),
#      CUDA kernel launches per round printed from each path's profile;
#   9. the same shape on shape scenes of 448-1344 px (1-12 tiles), 6 questions each: where the
#      prefix cache should pay (choose the cache's GPU default from this row);
#  10. bench/qpm.py on a random-weight Qwen2.5-VL-3B shape (the Qwen-VL family, its vision
#      tower through the token-budget graph pool);
#  11. vlmbatch eval --quant fp8: the built-in model's accuracy with FP8 linears (the CPU
#      reference of the same arithmetic gave 0.9985, as fp32);
#  12. bench/vit.py --compile on the InternViT-300M shape, batches 1, 4, 32 (torch.compile per
#      bucket, captured by the graph pool; each bucket compiles first: minutes).
# Steps 9-12 have never run. Not run unless named in STEPS (too long for one lease): "qpm
# 8b-shape" (a random model of InternVL3-8B's shape: ~50 GB of host memory while it is built,
# ~16 GB on disk in bf16).
# STEPS="gpu tests,qpm bench" runs only the steps named (a rerun inside the device budget);
# QPM_IMAGES sets the built-in model's QPM run's images (default 500).
# Writes the whole log to $OUT/gpu_check.txt (./out without $OUT) and ends with a table of
# steps, exit codes and seconds (exit 1, naming them on stderr, when a step failed: a bench
# whose check fails exits 1 too); bench/qpm.py also writes one profile per vlmbatch path there.
# Each step has its own time limit; on the H200 the script ran in about 4 minutes (docs/gpu.md).
#
#   bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"; mkdir -p "$out"
PY="${PYTHON:-python3}"  # the lent machine's torch lives in its python3; it may have no `python`
log="$out/gpu_check.txt"; : > "$log"
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl 2>&1 | tee -a "$log"
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
summary=()
failed=()
OPTIONAL=",qpm 8b-shape,"  # steps that run only when STEPS names them
step() {  # step NAME LIMIT_S CMD...: full output to the log, its tail to stdout
  local name=$1 limit=$2; shift 2
  if [[ -n "${STEPS:-}" && ",$STEPS," != *",$name,"* ]]; then return; fi
  if [[ -z "${STEPS:-}" && "$OPTIONAL" == *",$name,"* ]]; then return; fi
  local t0=$SECONDS
  echo "== $name: $*" | tee -a "$log"
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log" | tail -n 30
  local rc=${PIPESTATUS[0]}
  if [[ $rc -ne 0 ]]; then failed+=("$name"); fi
  summary+=("$(printf '| %-14s | %3s | %4ss |' "$name" "$rc" "$((SECONDS - t0))")")
}
{
  echo "== $(date -u) $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)"
  "$PY" -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), 'transformers', transformers.__version__)"
  "$PY" -c "import tensorrt; print('tensorrt', tensorrt.__version__)" 2>&1 | tail -1
} 2>&1 | tee -a "$log"
# limits of the default steps sum to 1,210 s (too much for one 10-minute call: split with
# STEPS); before steps 9-11 were added, the whole script ran in about 4 minutes on the H200
# (-o timeout: pytest-timeout, on the lent machine's image, stops one hung test; elsewhere a
# warning)
step "gpu tests" 120 "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider -o timeout=90 tests
step "vit bench" 120 "$PY" bench/vit.py --device cuda --encoders builtin,300m --reps 20 --rounds 3
step "qpm bench" 150 "$PY" bench/qpm.py --device cuda --dtype bfloat16 \
  --images "${QPM_IMAGES:-500}" --rounds 3 --profile "$out"
step "qpm 1b-shape" 240 "$PY" bench/qpm.py --device cuda --dtype bfloat16 --images 100 \
  --rounds 2 --random-shape internvl3-1b --fp8 --compile-llm --profile "$out/1b"
step "qpm 1b-scenes" 150 "$PY" bench/qpm.py --device cuda --dtype bfloat16 --images 48 \
  --rounds 2 --random-shape internvl3-1b --scene-sizes 448x448,896x672,1344x896 \
  --questions-per-image 6
step "qpm qwen2.5-vl-3b-shape" 240 "$PY" bench/qpm.py --device cuda --dtype bfloat16 \
  --images 40 --rounds 1 --random-shape qwen2.5-vl-3b --profile "$out/qwen"
step "int4 linears" 45 "$PY" bench/quant.py --linears-only --device cuda --rounds 3
step "gqa attention" 25 "$PY" bench/attention.py --device cuda --dtype bfloat16
step "eval on cuda" 40 "$PY" -m vlmbatch eval --device cuda --dtype bfloat16 --no-progress
step "eval fp8" 40 "$PY" -m vlmbatch eval --device cuda --dtype bfloat16 --quant fp8 --no-progress
step "prefetch" 60 "$PY" bench/prefetch.py --device cuda --dtype bfloat16 --images 96 \
  --threads-list 0,2,8,16 --rounds 2
step "vit compile" 240 "$PY" bench/vit.py --device cuda --encoders 300m --compile \
  --batches 1,4,32 --reps 20 --rounds 2
step "qpm 8b-shape" 420 "$PY" bench/qpm.py --device cuda --dtype bfloat16 --images 48 \
  --rounds 2 --random-shape internvl3-8b --scene-sizes 448x448,896x672 \
  --questions-per-image 6 --fp8
{
  echo; echo "| step | rc | time |"; echo "|---|---|---|"
  printf '%s\n' "${summary[@]}"
} | tee -a "$log"
if (( ${#failed[@]} )); then  # a failed check or step fails the script (after the table)
  echo "gpu_check.sh: steps that failed: $(IFS=,; echo "${failed[*]}")" | tee -a "$log" >&2
  exit 1
fi
