#!/usr/bin/env bash
# Run HERE (the dev machine, which reaches PyPI) before a device run: downloads into .whl/ the
# wheels that the lent GPU machine's image lacks (it has torch, transformers, onnxruntime,
# opencv, xxhash, pyyaml, tqdm, pillow, pyarrow, pytest; see the device tool's KINDS.md), for
# its Python 3.12 on x86-64. bench/gpu_check.sh installs whatever .whl/ holds. Then:
#
#   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=560)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
# easy-vqa: the test split that bench/qpm.py answers (pure Python + its images, 3 MB).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  -d .whl easy-vqa==1.0
ls -la .whl
