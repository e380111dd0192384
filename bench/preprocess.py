"""Preprocessing benchmark: InternVL's Pillow reference vs ours, file bytes -> model-ready.

Paths, all single-threaded (``cv2.setNumThreads(1)``, one torch thread), same images, one
process:

(a) reference, as InternVL's model card: ``Image.open(...).convert('RGB')``,
    ``dynamic_preprocess`` (448 px, max 12 tiles, thumbnail), ToTensor + Normalize -> float32
    ``[N, 3, 448, 448]`` (``preprocessing/reference.py``);
(b) ours, reference tiling, as ``vlmbatch run`` does it (``prepare_bytes``): OpenCV decode
    (a large JPEG decoded at 1/2, 1/4 or 1/8 scale in the DCT domain when its tiles need no
    more), INTER_AREA/INTER_CUBIC resize, the same grid -> uint8 ``[N, 448, 448, 3]``
    (normalisation runs inside the vision encoder, on its device); (b') the same with every
    image decoded at full size;
(c) ours, (b) plus a CPU float normalisation, for an apples-to-apples comparison with (a);
(d) ours, reduced-token tiling -> uint8 tiles.

Images: the real photographs shipped inside scikit-image's wheel (``skimage/data``;
``pip install --no-deps scikit-image``: only its data files are read,
skimage is never imported), each re-encoded as JPEG at 320x240, 640x480, 1024x768 and
1920x1080, plus synthetic 4000x3000 JPEGs. Prints images/s per path, the ratios to (a),
tokens per image per tiling mode, and (b) with 1 and 2 worker processes.

    python bench/preprocess.py
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import cv2
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlmbatch.preprocessing.decode import decode  # noqa: E402
from vlmbatch.preprocessing.limits import DEFAULT_MAX_PIXELS  # noqa: E402
from vlmbatch.preprocessing.prepare import TilingConfig, prepare, prepare_bytes  # noqa: E402
from vlmbatch.preprocessing.reference import pillow_tiles, pixel_values  # noqa: E402

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
REF = TilingConfig(tile_size=448, max_tiles=12)
RED = TilingConfig(tile_size=448, max_tiles=12, mode="reduced")
SIZES = [(320, 240), (640, 480), (1024, 768), (1920, 1080)]


def photos() -> list[Path]:
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("bench/preprocess.py needs the photos inside scikit-image's wheel: "
                 "pip install --no-deps scikit-image")
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    names = ["astronaut.png", "coffee.png", "chelsea.png", "motorcycle_left.png",
             "hubble_deep_field.jpg", "retina.jpg", "rocket.jpg", "camera.png"]
    return [data / n for n in names if (data / n).is_file()]


def corpus(n_large: int) -> list[bytes]:
    from PIL import Image

    out = []
    for p in photos():
        im = Image.open(p).convert("RGB")
        for w, h in SIZES:
            buf = io.BytesIO()
            im.resize((w, h), Image.Resampling.LANCZOS).save(buf, "JPEG", quality=90)
            out.append(buf.getvalue())
    rng = np.random.default_rng(0)
    for _ in range(n_large):
        big = cv2.resize(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8), (4000, 3000),
                         interpolation=cv2.INTER_CUBIC)
        ok, enc = cv2.imencode(".jpg", big, [cv2.IMWRITE_JPEG_QUALITY, 90])
        out.append(enc.tobytes())
    return out


def reference(data: bytes) -> torch.Tensor:
    t = REF
    return pixel_values(pillow_tiles(data, t.tile_size, t.min_tiles, t.max_tiles), MEAN, STD)


def ours(data: bytes) -> np.ndarray:
    return prepare_bytes(data, REF, DEFAULT_MAX_PIXELS).tiles


def ours_full_decode(data: bytes) -> np.ndarray:
    return prepare(decode(data), REF).tiles


def ours_float(data: bytes) -> torch.Tensor:
    x = torch.from_numpy(ours(data)).permute(0, 3, 1, 2).float()
    scale = torch.tensor([1 / (255 * s) for s in STD]).view(1, 3, 1, 1)
    shift = torch.tensor([-m / s for m, s in zip(MEAN, STD)]).view(1, 3, 1, 1)
    return x * scale + shift


def ours_reduced(data: bytes) -> np.ndarray:
    return prepare_bytes(data, RED, DEFAULT_MAX_PIXELS).tiles


def rate(fn, images: list[bytes], repeat: int) -> float:  # noqa: ANN001
    fn(images[0])  # warm-up
    start = time.perf_counter()
    for _ in range(repeat):
        for d in images:
            fn(d)
    return repeat * len(images) / (time.perf_counter() - start)


def _init_worker() -> None:
    cv2.setNumThreads(1)
    torch.set_num_threads(1)


def pool_rate(images: list[bytes], workers: int, repeat: int) -> float:
    with ProcessPoolExecutor(workers, initializer=_init_worker) as pool:
        list(pool.map(ours, images[:workers]))  # start the workers
        start = time.perf_counter()
        for _ in range(repeat):
            list(pool.map(ours, images, chunksize=4))
        return repeat * len(images) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--large", type=int, default=4, help="synthetic 4000x3000 JPEGs")
    args = ap.parse_args()
    _init_worker()
    images = corpus(args.large)
    tok_ref = np.mean([prepare(decode(d), REF).grid.num_tiles * 256 for d in images])
    tok_red = np.mean([prepare(decode(d), RED).grid.num_tiles * 256 for d in images])
    print(f"{len(images)} images ({len(photos())} scikit-image photos x {len(SIZES)} sizes + "
          f"{args.large} x 4000x3000), 1 thread, 448 px tiles, max 12")
    rows = [("(a) reference: Pillow + dynamic_preprocess + Normalize", reference),
            ("(b) ours: OpenCV, uint8 tiles (as `vlmbatch run`)", ours),
            ("(b') (b) without the JPEG DCT-reduced decode", ours_full_decode),
            ("(c) ours + CPU float normalisation", ours_float),
            ("(d) ours, reduced-token tiling", ours_reduced)]
    base = None
    print(f"{'path':<60}{'images/s':>10}{'x (a)':>8}")
    for name, fn in rows:
        r = rate(fn, images, args.repeat)
        base = base or r
        print(f"{name:<60}{r:>10.1f}{r / base:>8.2f}")
    print(f"tokens per image (256 per tile): reference {tok_ref:.0f}, reduced {tok_red:.0f} "
          f"({tok_red / tok_ref:.2f}x)")
    for workers in (1, 2):
        print(f"(b) with {workers} worker process(es): "
              f"{pool_rate(images, workers, args.repeat):.1f} images/s")


if __name__ == "__main__":
    main()
