"""Print the tiles/tokens table of docs/preprocessing.md: both tiling modes, 448 px tiles,
256 tokens per tile (InternVL2/2.5/3), 1..12 tiles.

    python scripts/tiling_table.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlmbatch.preprocessing.tiling import fit_scale, plan_reduced, plan_reference  # noqa: E402

SIZES = [(480, 320), (480, 360), (612, 464), (896, 1344), (1920, 1080), (4000, 3000), (64, 64),
         (100, 2000)]


def main() -> None:
    print("| image (w x h) | reference grid | tiles | tokens | reduced grid | tiles | tokens "
          "| reduced scale |")
    print("|---|---|---|---|---|---|---|---|")
    for w, h in SIZES:
        r = plan_reference(w, h, 448, 1, 12, use_thumbnail=True)
        d = plan_reduced(w, h, 448, 1, 12)
        s = fit_scale(w, h, 448, d.cols, d.rows)

        def grid(g) -> str:  # noqa: ANN001
            return f"{g.cols}x{g.rows}" + (" + thumb" if g.thumbnail else "")

        print(f"| {w} x {h} | {grid(r)} | {r.num_tiles} | {r.num_tiles * 256} | {grid(d)} | "
              f"{d.num_tiles} | {d.num_tiles * 256} | {s:.2f} |")


if __name__ == "__main__":
    main()
