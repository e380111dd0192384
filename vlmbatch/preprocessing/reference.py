"""The reference preprocessing of InternVL's model card, in Pillow: the baseline we compare to.

Model card recipe: ``Image.open(f).convert('RGB')``; ``dynamic_preprocess`` (resize the whole
image to the chosen grid with Pillow bicubic, crop tiles row-major, append a thumbnail);
torchvision ``Resize(BICUBIC) -> ToTensor -> Normalize(ImageNet mean/std)`` per tile.
torchvision does not install beside our CPU torch build, so ToTensor/Normalize are written out
(``/255`` then ``(x - mean) / std``); on PIL images torchvision's Resize is Pillow's resize,
and the tiles are already tile-sized, so it is the identity here.

Uses Pillow (a core dependency). Never used on the serving path. Used by benchmarks and tests
today, and kept in the package (not in tests/) because issue 44 makes it a run mode
(``--resize reference``).
"""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from vlmbatch.preprocessing.tiling import closest_grid


def pillow_tiles(data: bytes, tile: int, min_tiles: int, max_tiles: int,
                 use_thumbnail: bool = True) -> list:
    """Encoded bytes -> list of ``tile`` x ``tile`` PIL RGB images, InternVL order."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = image.size
    cols, rows = closest_grid(w, h, tile, min_tiles, max_tiles)
    resized = image.resize((cols * tile, rows * tile), Image.Resampling.BICUBIC)
    tiles = [resized.crop(((i % cols) * tile, (i // cols) * tile,
                           (i % cols + 1) * tile, (i // cols + 1) * tile))
             for i in range(cols * rows)]
    if use_thumbnail and len(tiles) != 1:
        tiles.append(image.resize((tile, tile), Image.Resampling.BICUBIC))
    return tiles


def pixel_values(tiles: list, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """PIL tiles -> ``[N, 3, S, S]`` float32, ToTensor + Normalize."""
    x = torch.from_numpy(np.stack([np.asarray(t, dtype=np.uint8) for t in tiles]))
    x = x.permute(0, 3, 1, 2).float() / 255.0
    return (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
