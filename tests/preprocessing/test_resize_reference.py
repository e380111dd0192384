"""``--resize reference`` vs transformers' image processors: pixel_values within 1e-6.

Each family's processor is built from its constructor (no download) with the checkpoint's
sizes: ``Qwen2VLImageProcessor`` (torchvision backend, what ``AutoImageProcessor`` gives for
Qwen2-VL, Qwen2.5-VL and Qwen3-VL whenever torchvision is installed), its Pillow backend
(``Qwen2VLImageProcessorPil``, what it falls back to without), ``GotOcr2ImageProcessor``
(HF-native InternVL, ``crop_to_patches``) and the model card's Pillow pipeline of the original
InternVL checkpoints (``preprocessing/reference.py``). Our uint8 rows are normalised the way
the towers do it (``x * 1/(255 std) - mean/std``, Python floats, float32 tensors) and compared
with the processor's ``pixel_values``. Sizes are the awkward ones: tiny, 37x1900, 64 px
upscaled, 1000+ px downscaled. The OpenCV mode is shown to miss the same bound by far, so the
comparison can fail.
"""

from __future__ import annotations

import sys
from io import BytesIO
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from vlmbatch.preprocessing.prepare import TilingConfig, prepare
from vlmbatch.preprocessing.qwen_vl import QwenVLPreprocess, prepare_qwen_vl
from vlmbatch.preprocessing.reference import pillow_tiles, pixel_values
from vlmbatch.preprocessing.resize import KERNELS, resize

# transformers' torchvision-backend processors import torchvision at module level: these
# tests run where it imports (tests/conftest.py: a CUDA env, or our CPU env with PyPI's
# torchvision 0.28 on PYTHONPATH); the Pillow ones run everywhere
needs_tv = pytest.mark.skipif("torchvision" not in sys.modules, reason="needs torchvision on "
                              "the path (tests/conftest.py says how; never installed beside "
                              "our CPU torch)")


TOL = 1e-6
CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
# (w, h): tiny, a strip, 64 px (upscaled under the pixel floors below), 1000+ px (downscaled)
SIZES = [(5, 3), (37, 1900), (64, 64), (1000, 1100), (1203, 777)]
QWEN = {  # name: (our plan, mean, std); floors raised so that 64 px is upscaled
    "qwen2_vl": (QwenVLPreprocess(14, 2, 2, 112 * 112, 28 * 28 * 300), *CLIP),
    "qwen3_vl": (QwenVLPreprocess(16, 2, 2, 128 * 128, 32 * 32 * 256), (0.5,) * 3, (0.5,) * 3),
}


def random_image(w: int, h: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def tower_normalised(x: torch.Tensor, mean: tuple, std: tuple, dim: int) -> torch.Tensor:
    """uint8 ``x`` as the vision towers normalise it: channel ``c`` along ``dim`` (channel-major
    within it) times ``1/(255 std_c)`` plus ``-mean_c/std_c``, in float32."""
    per = x.shape[dim] // 3
    shape = [1] * x.ndim
    shape[dim] = x.shape[dim]
    scale = torch.tensor([1.0 / (255.0 * s) for s in std]).repeat_interleave(per)
    shift = torch.tensor([-m / s for m, s in zip(mean, std)]).repeat_interleave(per)
    return x.float() * scale.view(shape) + shift.view(shape)


def qwen_error(name: str, kernel: str, backend: str, w: int, h: int) -> float:
    plan, mean, std = QWEN[name]
    img = random_image(w, h, seed=w * 7 + h)
    cls: type = Qwen2VLImageProcessorPil
    if backend == "torchvision":
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
            Qwen2VLImageProcessor,
        )
        cls = Qwen2VLImageProcessor
    proc = cls(patch_size=plan.patch, merge_size=plan.merge, temporal_patch_size=plan.temporal,
               image_mean=list(mean), image_std=list(std), min_pixels=plan.min_pixels,
               max_pixels=plan.max_pixels)
    want = proc(images=[img], return_tensors="pt", input_data_format="channels_last")
    ours = prepare_qwen_vl(img, QwenVLPreprocess(plan.patch, plan.merge, plan.temporal,
                                                 plan.min_pixels, plan.max_pixels, kernel))
    assert ours.grid.thw == tuple(int(v) for v in want["image_grid_thw"][0])
    got = tower_normalised(torch.from_numpy(ours.rows), mean, std, dim=1)
    assert got.shape == want["pixel_values"].shape
    return float((got - want["pixel_values"].float()).abs().max())


@needs_tv
@pytest.mark.parametrize("name", QWEN)
@pytest.mark.parametrize("w,h", SIZES)
def test_qwen_reference_equals_qwen2vl_image_processor(name: str, w: int, h: int) -> None:
    assert qwen_error(name, "torchvision", "torchvision", w, h) <= TOL


@pytest.mark.parametrize("w,h", SIZES)
def test_pillow_kernel_equals_the_pil_backend(w: int, h: int) -> None:
    """transformers' own fallback without torchvision (``backend="pil"``) is Pillow's bicubic."""
    assert qwen_error("qwen2_vl", "pillow", "pil", w, h) <= TOL


@needs_tv
@pytest.mark.parametrize("name", QWEN)
def test_opencv_mode_misses_the_bound(name: str) -> None:
    """The default mode resizes with OpenCV: the same comparison fails, by far, wherever a
    resize happens (so the tests above can fail)."""
    errors = [qwen_error(name, "opencv", "torchvision", w, h) for w, h in SIZES]
    assert min(errors) > 100 * TOL, errors


def internvl_error(kernel: str, w: int, h: int, backend: str = "torchvision", tile: int = 96,
                   max_tiles: int = 6) -> float:
    """Ours (reference tiling, ``kernel``) vs GotOcr2ImageProcessor's crop_to_patches (its
    ``torchvision`` or ``pil`` backend)."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
        GotOcr2ImageProcessorPil,
    )

    cls: type = GotOcr2ImageProcessorPil
    if backend == "torchvision":
        from transformers.models.got_ocr2.image_processing_got_ocr2 import (
            GotOcr2ImageProcessor,
        )
        cls = GotOcr2ImageProcessor
    img = random_image(w, h, seed=w + 3 * h)
    proc = cls(size={"height": tile, "width": tile}, crop_to_patches=True,
               min_patches=1, max_patches=max_tiles,
               image_mean=list(IMAGENET[0]), image_std=list(IMAGENET[1]))
    want = proc(images=[img], return_tensors="pt",
                input_data_format="channels_last")["pixel_values"]
    cfg = TilingConfig(tile, 1, max_tiles, True, mode="reference", resize=kernel)
    tiles = torch.from_numpy(prepare(img, cfg).rows).permute(0, 3, 1, 2)  # [N, 3, S, S]
    got = tower_normalised(tiles.contiguous(), *IMAGENET, dim=1)
    assert got.shape == want.shape
    return float((got - want.float()).abs().max())


@needs_tv
@pytest.mark.parametrize("w,h", SIZES)
def test_internvl_reference_equals_got_ocr2_processor(w: int, h: int) -> None:
    assert internvl_error("torchvision", w, h) <= TOL


@pytest.mark.parametrize("w,h", SIZES)
def test_pillow_kernel_equals_got_ocr2_pil_backend(w: int, h: int) -> None:
    """HF InternVL under --resize pillow: transformers' processor without torchvision."""
    assert internvl_error("pillow", w, h, backend="pil") <= TOL


@needs_tv
def test_internvl_opencv_misses_the_bound() -> None:
    assert min(internvl_error("opencv", w, h) for w, h in SIZES) > 100 * TOL


@pytest.mark.parametrize("w,h", SIZES)
def test_internvl_chat_reference_equals_the_model_card(w: int, h: int) -> None:
    """The original checkpoints' model card: Pillow bicubic tiles, ToTensor, Normalize."""
    img = random_image(w, h, seed=w * 5 + h)
    png = BytesIO()
    Image.fromarray(img).save(png, format="PNG")
    want = pixel_values(pillow_tiles(png.getvalue(), 96, 1, 6), *IMAGENET)
    cfg = TilingConfig(96, 1, 6, True, mode="reference", resize="pillow")
    tiles = torch.from_numpy(prepare(img, cfg).rows).permute(0, 3, 1, 2).contiguous()
    assert float((tower_normalised(tiles, *IMAGENET, dim=1) - want).abs().max()) <= TOL


def test_equal_size_is_left_alone_and_kernels_are_checked() -> None:
    img = random_image(28, 56, seed=1)
    assert all(resize(img, 28, 56, k) is img for k in KERNELS)
    with pytest.raises(ValueError, match="resize kernel 'lanczos' not one of"):
        resize(img, 10, 10, "lanczos")
    with pytest.raises(ValueError, match="resize kernel"):
        QwenVLPreprocess(resize="bilinear")


@pytest.mark.parametrize("kernel", ["torchvision", "pillow"])
def test_reference_kernels_decode_the_whole_image(kernel: str) -> None:
    """A processor resizes from every pixel, so no DCT-reduced decode under a reference
    kernel (``need`` asks for the full image); the default still asks for less."""
    big = (4000, 3000)
    assert QwenVLPreprocess(resize=kernel).need(*big) == big
    assert TilingConfig(resize=kernel).need(*big) == big
    assert QwenVLPreprocess().need(*big) != big


# Where torchvision is absent (our CI), the torchvision kernel is still checked: xxh3-128 of
# the uint8 pixels Qwen2VLImageProcessor (torchvision backend, transformers 5.25, torchvision
# 0.28.0) resized each image to, recovered from its pixel_values (x * std + mean) * 255,
# rounded; made by processor_pixels below with torchvision on the path, and re-checked
# against the live processor wherever it imports.
PROCESSOR_HASHES = {  # (w, h): hash; seed w * 7 + h, QWEN["qwen2_vl"]'s plan
    (5, 3): "7d62e787e768c6d8bb0622c97a2b3f3d",
    (37, 1900): "bfd47e13b5590ae98ade5623be22f76d",
    (64, 64): "502a7e6ed8a9dd0bb7583fb4b90515ee",
    (1000, 1100): "f4b3e4d4333c5a9dde7b39accaf15775",
    (1203, 777): "ab3b760f53e1874491023500245a094a",
}


def processor_pixels(w: int, h: int) -> np.ndarray:
    """The processor's resized uint8 image [h', w', 3] (its patch rows un-normalised and
    put back in place)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    plan, mean, std = QWEN["qwen2_vl"]
    proc = Qwen2VLImageProcessor(patch_size=plan.patch, merge_size=plan.merge,
                                 temporal_patch_size=plan.temporal, image_mean=list(mean),
                                 image_std=list(std), min_pixels=plan.min_pixels,
                                 max_pixels=plan.max_pixels)
    out = proc(images=[random_image(w, h, seed=w * 7 + h)], return_tensors="pt",
               input_data_format="channels_last")
    _, gh, gw = (int(v) for v in out["image_grid_thw"][0])
    p, m = plan.patch, plan.merge
    # rows [wy, wx, my, mx] x [c, t, py, px] -> [wy, my, py, wx, mx, px, c], frame t = 0
    x = out["pixel_values"].reshape(gh // m, gw // m, m, m, 3, 2, p, p)[:, :, :, :, :, 0]
    x = x.permute(0, 2, 5, 1, 3, 6, 4).reshape(gh * p, gw * p, 3)
    px = x * torch.tensor(std) + torch.tensor(mean)
    return (px * 255).round().clamp(0, 255).to(torch.uint8).numpy()


def xxh(a: np.ndarray) -> str:
    import xxhash
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(a).tobytes())


@pytest.mark.parametrize("w,h", list(PROCESSOR_HASHES))
def test_torchvision_kernel_equals_the_processors_recorded_pixels(w: int, h: int) -> None:
    plan = QWEN["qwen2_vl"][0]
    img = random_image(w, h, seed=w * 7 + h)
    th, tw = plan.target_size(h, w)
    ours = resize(img, tw, th, "torchvision")
    assert xxh(ours) == PROCESSOR_HASHES[(w, h)]
    assert xxh(resize(img, tw, th, "opencv")) != PROCESSOR_HASHES[(w, h)]


@needs_tv
@pytest.mark.parametrize("w,h", list(PROCESSOR_HASHES))
def test_recorded_pixels_are_the_live_processors(w: int, h: int) -> None:
    assert xxh(processor_pixels(w, h)) == PROCESSOR_HASHES[(w, h)]


def test_each_family_names_its_processors_kernel(tmp_path: Path) -> None:
    """--resize reaches each family's plan: reference is torchvision's resize for Qwen-VL and
    HF-layout InternVL, Pillow's for the original layout; opencv and pillow are theirs."""
    from tests.models.internvl_original_helpers import make_pair
    from vlmbatch.engine.config import ModelConfig
    from vlmbatch.engine.loading import image_plan_for, read_spec
    from vlmbatch.models.paths import DEFAULT_QWEN_MODEL

    hf, original = make_pair(tmp_path, "internvl2_5_qwen2")
    want = {DEFAULT_QWEN_MODEL: "torchvision", hf: "torchvision", original: "pillow"}
    for path, kernel in want.items():
        for mode, expected in (("reference", kernel), ("opencv", "opencv"),
                               ("pillow", "pillow")):
            plan = image_plan_for(*read_spec(path), ModelConfig(path=path, resize=mode))
            assert plan.resize == expected, (path, mode)  # type: ignore[attr-defined]
