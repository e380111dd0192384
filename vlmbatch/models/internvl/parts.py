"""InternVL prompts holding several visual parts (images and clips, in order), as transformers
5.25's ``InternVLProcessor`` and InternVL's own chat code write them.

Every part is followed by the text the format puts after an image placeholder (``between``:
``\\n`` in both layouts), the question after the last part. An image is ``<img>`` + N x
``<IMG_CONTEXT>`` + ``</img>`` (N = tokens per tile x its tiles), a clip one 448 px tile per
frame, written as the processor's ``replace_video_token`` does: ``Frame{i}: <img>...</img>``
lines joined by ``\\n`` (InternVL's model card writes ``Frame{i}: <image>\\n`` per frame: the
same text once ``between`` follows the clip; vLLM joins the frames without the newline, a
different prompt). Several images: an HF-native checkpoint's chat template renders each
image part alone (``<img>...</img>\\n`` back to back); an original checkpoint's prompt
numbers them as its model card's multi-image example does (``Image-1: <image>\\nImage-2:
<image>\\n{question}``). One image alone is written as ``prompt.py`` writes it.
"""

from __future__ import annotations

from collections.abc import Sequence

from vlmbatch.preprocessing.media import MediaPart, PreparedVideo
from vlmbatch.preprocessing.tiling import TileGrid


def parts_text(parts: Sequence[MediaPart], between: str, numbered: bool, tokens_per_tile: int,
               marks: tuple[str, str, str]) -> tuple[str, list[int]]:
    """The parts' text (each followed by ``between``) and each part's number of
    ``<IMG_CONTEXT>`` runs (an image: 1; a clip: its frames)."""
    start, context, end = marks
    images = sum(not isinstance(p, PreparedVideo) for p in parts)
    label = numbered and images > 1
    text, runs, k = "", [], 0
    for part in parts:
        if isinstance(part, PreparedVideo):
            frame = start + context * tokens_per_tile + end
            text += "\n".join(f"Frame{i + 1}: {frame}" for i in range(len(part.rows)))
            runs.append(len(part.rows))
        else:
            assert isinstance(part.grid, TileGrid)  # InternVL's plan made it
            k += 1
            text += (f"Image-{k}: " if label else "") + start + context * (
                tokens_per_tile * part.grid.num_tiles) + end
            runs.append(1)
        text += between
    return text, runs


def context_runs(ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    """The runs ``(start, length)`` of ``token`` in ``ids``."""
    runs: list[tuple[int, int]] = []
    for i, x in enumerate(ids):
        if x != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs
