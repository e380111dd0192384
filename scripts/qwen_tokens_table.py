"""Print the Qwen-VL image-token table of docs/qwen_vl.md: the 58.com write-up's image sizes
through smart resize at each family's default pixel range (the released checkpoints'
preprocessor_config.json: Qwen2/2.5-VL 3,136..12,845,056 pixels, 28 px per token side;
Qwen3-VL 65,536..16,777,216, 32 px) and with ``--max-image-tokens 256``; InternVL's
reference tiling (448 px tiles, 256 tokens each, up to 12 + thumbnail) beside them.

    python scripts/qwen_tokens_table.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlmbatch.preprocessing.qwen_vl import QwenVLPreprocess  # noqa: E402
from vlmbatch.preprocessing.tiling import plan_reference  # noqa: E402

SIZES = [(480, 320), (612, 464), (896, 1344), (1920, 1080)]  # (w, h), seed 001
PLANS = {"Qwen2/2.5-VL": QwenVLPreprocess(14, 2, 2, 3136, 12845056),
         "Qwen3-VL": QwenVLPreprocess(16, 2, 2, 65536, 16777216)}
BUDGET = 256


def main() -> None:
    cols = [f"{name}{extra}" for name in PLANS for extra in ("", f", <= {BUDGET} tokens")]
    print("| image (w x h) | InternVL reference | " + " | ".join(cols) + " |")
    print("|---" * (2 + len(cols)) + "|")
    for w, h in SIZES:
        cells = [f"{plan_reference(w, h, 448, 1, 12, True).num_tiles * 256}"]
        for plan in PLANS.values():
            for p in (plan, plan.with_max_tokens(BUDGET)):
                th, tw = p.target_size(h, w)
                cells.append(f"{p.tokens(h, w)} ({tw}x{th})")
        print(f"| {w}x{h} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
