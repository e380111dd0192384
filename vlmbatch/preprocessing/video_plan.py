"""A family's whole video recipe (``VideoPlan``), and reading it from a checkpoint.

``VideoPlan.prepare(data, max_pixels)`` is bytes -> ``PreparedVideo``: open the clip and read
its metadata (``video.py``), sample the frame indices (``video_sampling.py``), decode just
those, each resized as decoded (``video_rows.fit_for``), and lay them out as rows
(``video_rows.py``). It runs in the decoder processes under their deadline
(``decoder_process.py``), as an image's plan does.

``checkpoint_video(path, family)`` reads the checkpoint's video processor settings as
transformers' ``from_pretrained`` does: ``processor_config.json``'s ``video_processor`` if
present, else ``video_preprocessor_config.json``, else the image processor's
``preprocessor_config.json``; keys it lacks take the family processor's class defaults.
Qwen2-VL's ``min_pixels``/``max_pixels`` override ``size`` as its ``__init__`` does. One
difference, said here: a checkpoint whose processor does not sample (``do_sample_frames``
false, Qwen2-VL's class default) is still sampled at ``fps`` (2 unless given), as
qwen-vl-utils and vLLM do; decoding every frame of a clip is not an option we offer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from vlmbatch.preprocessing.media import PreparedVideo, WindowedClip
from vlmbatch.preprocessing.qwen_vl import QwenVLPreprocess
from vlmbatch.preprocessing.video import DEFAULT_MAX_VIDEO_SECONDS, VideoError, open_clip
from vlmbatch.preprocessing.video_budget import BudgetedLayout, check_context, internvl_frames
from vlmbatch.preprocessing.video_rows import (
    FrameTiles,
    QwenVideoLayout,
    Resize,
    fit_for,
    prepare_internvl_video,
    prepare_qwen_video,
)
from vlmbatch.preprocessing.video_sampling import ClipInfo, SamplingError, VideoSampling
from vlmbatch.preprocessing.video_windows import WindowRecipe, prepare_windows

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_STANDARD = (0.5, 0.5, 0.5)
INTERNVL_NUM_FRAMES = 8  # the model card's and transformers' docs' example: 8 segments

# The family processors' class defaults (transformers 5.25): video_processing_*.py
_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2_vl": {"size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
                 "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
                 "min_frames": 4, "max_frames": 768, "fps": None, "num_frames": None,
                 "image_mean": OPENAI_CLIP_MEAN, "image_std": OPENAI_CLIP_STD},
    "qwen3_vl": {"size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
                 "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                 "min_frames": 4, "max_frames": 768, "fps": 2, "num_frames": None,
                 "image_mean": IMAGENET_STANDARD, "image_std": IMAGENET_STANDARD},
    "internvl": {"size": {"height": 384, "width": 384}, "fps": None, "num_frames": None,
                 "image_mean": OPENAI_CLIP_MEAN, "image_std": OPENAI_CLIP_STD},
}


@dataclass(frozen=True)
class VideoPlan:
    """How one checkpoint wants its clips: which frames, which rows, which limits."""
    sampling: VideoSampling
    layout: QwenVideoLayout | FrameTiles
    max_seconds: float = DEFAULT_MAX_VIDEO_SECONDS
    resize: Resize | None = None  # None: OpenCV's policy (resize.py); picklable if set
    mean: tuple[float, ...] = field(default=OPENAI_CLIP_MEAN)  # the vision module's
    std: tuple[float, ...] = field(default=OPENAI_CLIP_STD)
    max_tokens: int | None = None  # the clip's visual token budget (video_budget.py)
    frame_tokens: int = 0  # InternVL: visual tokens per frame (its tile's); 0: not known
    context: int = 0  # the model's context in tokens; 0: none stated, not checked
    # (segment_seconds, segment_stride or None): the clip in windows (video_windows.py)
    windows: tuple[float, float | None] | None = None

    def with_sampling(self, fps: float | None = None, num_frames: int | None = None,
                      max_frames: int | None = None, max_tokens: int | None = None
                      ) -> VideoPlan:
        """This plan with a user's sampling keys (``fps`` and ``num_frames`` exclusive) and
        token budget (None: this plan's)."""
        if max_tokens is not None:
            self = replace(self, max_tokens=max_tokens)
        s = self.sampling
        if fps is not None or num_frames is not None:
            s = replace(s, fps=fps, num_frames=num_frames)
        if max_frames is not None:
            s = replace(s, max_frames=max_frames, min_frames=min(s.min_frames, max_frames))
        return replace(self, sampling=s)

    def with_windows(self, seconds: float | None, stride: float | None = None) -> VideoPlan:
        """This plan cutting clips into windows of ``seconds`` every ``stride`` (None:
        ``seconds``); as it is when ``seconds`` is None."""
        return self if seconds is None else replace(self, windows=(seconds, stride))

    def prepare(self, data: bytes, max_pixels: int) -> PreparedVideo | WindowedClip:
        """Encoded clip -> ``PreparedVideo`` (in windows: ``WindowedClip``); raises
        ``VideoError`` (the item's error)."""
        if self.windows is not None:
            recipe = WindowRecipe(self.sampling, self.layout, self.resize, self.max_seconds,
                                  self._sized(), self._indices)
            windowed = prepare_windows(recipe, data, max_pixels, *self.windows)
            for video in windowed.videos:  # each window is its own prompt
                check_context(self.tokens(video), self.context)
            return windowed
        with open_clip(data, max_pixels, self.max_seconds) as clip:
            try:
                indices = self._indices(clip.info)
            except SamplingError as e:
                raise VideoError(f"cannot sample the clip: {e}", "too_short") from None
            decoded = clip.frames(indices, fit_for(self._sized(), len(indices), self.resize))
        fps = self._fps(clip.info, len(indices))
        if isinstance(self.layout, FrameTiles):
            video = prepare_internvl_video(decoded, indices, fps, self.layout)
        else:
            video = prepare_qwen_video(decoded, indices, fps, self.layout)
        check_context(self.tokens(video), self.context)
        return video

    def _sized(self) -> QwenVideoLayout | FrameTiles | BudgetedLayout:
        """The layout frames are resized by: Qwen-VL's under a budget ``BudgetedLayout``."""
        if self.max_tokens is not None and isinstance(self.layout, QwenVideoLayout):
            return BudgetedLayout(self.layout, self.max_tokens)
        return self.layout

    def _indices(self, info: ClipInfo) -> np.ndarray:
        """The sampling's frames; InternVL's under a budget at most ``budget // frame_tokens``
        of them, sampled as transformers samples that ``num_frames`` (video_budget.py)."""
        indices = self.sampling.indices(info)
        if self.max_tokens is None or not isinstance(self.layout, FrameTiles) \
                or self.frame_tokens <= 0:
            return indices
        most = internvl_frames(self.max_tokens, self.frame_tokens)
        if len(indices) <= most:
            return indices
        return replace(self.sampling, fps=None, num_frames=most).indices(info)

    def tokens(self, video: PreparedVideo) -> int:
        """The clip's visual tokens: Qwen-VL's merged patches, InternVL's frames x
        ``frame_tokens`` (0 where that is not known)."""
        if isinstance(self.layout, FrameTiles):
            return len(video.frame_indices) * self.frame_tokens
        return video.rows.shape[0] // (self.layout.qwen.merge ** 2)

    def _fps(self, info: ClipInfo, n: int) -> float:
        """The sampling rate as transformers states it (``VideoMetadata.sampled_fps``, which
        Qwen2.5-VL's ``second_per_grid_ts`` divides by): sampled frames per source second,
        not the ``fps`` asked (flooring to whole temporal patches and the frame bounds move
        it)."""
        return n / info.total_frames * info.fps


def read_video_config(checkpoint: Path) -> dict[str, Any]:
    """The video processor's dict, from the file transformers would read (module
    docstring); {} when the checkpoint has none of them."""
    nested = checkpoint / "processor_config.json"
    if nested.is_file():
        d = json.loads(nested.read_text())
        if isinstance(d.get("video_processor"), dict):
            return d["video_processor"]
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (checkpoint / name).is_file():
            return json.loads((checkpoint / name).read_text())
    return {}


def checkpoint_video(checkpoint: Path | str, family: str) -> VideoPlan:
    """The checkpoint's ``VideoPlan`` (family: ``qwen2_vl``, ``qwen3_vl``, ``internvl``)."""
    if family not in _DEFAULTS:
        raise ValueError(f"no video plan for family {family!r}; one of {sorted(_DEFAULTS)}")
    cfg = {**_DEFAULTS[family], **read_video_config(Path(checkpoint))}
    size = dict(cfg.get("size") or {})
    if family == "qwen2_vl":  # Qwen2VLVideoProcessor.__init__: the old keys win
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if cfg.get(key) is not None:
                size[edge] = cfg[key]
    num_frames = cfg.get("num_frames")
    fps = None if num_frames is not None else cfg.get("fps")
    if family == "internvl":
        if num_frames is None and fps is None:
            num_frames = INTERNVL_NUM_FRAMES
        sampling = VideoSampling("internvl", fps=fps, num_frames=num_frames)
        layout: QwenVideoLayout | FrameTiles = FrameTiles(int(size.get("height", 448)))
    else:
        sampling = VideoSampling(family, fps=2.0 if fps is None and num_frames is None else fps,
                                 num_frames=num_frames, min_frames=int(cfg["min_frames"]),
                                 max_frames=int(cfg["max_frames"]),
                                 temporal=int(cfg["temporal_patch_size"]))
        qwen = QwenVLPreprocess(patch=int(cfg["patch_size"]), merge=int(cfg["merge_size"]),
                                temporal=int(cfg["temporal_patch_size"]),
                                min_pixels=int(size["shortest_edge"]),
                                max_pixels=int(size["longest_edge"]))
        layout = QwenVideoLayout(qwen, clip_budget=family == "qwen3_vl")
    return VideoPlan(sampling, layout, mean=tuple(cfg["image_mean"]), std=tuple(cfg["image_std"]))


def normalise(rows: np.ndarray, plan: VideoPlan) -> np.ndarray:
    """uint8 rows -> float32 as the vision module normalises them (``/255``, mean, std):
    Qwen rows ``[N, C*T*P*P]`` channel-major, InternVL tiles ``[F, S, S, 3]`` -> ``[F, 3, S,
    S]``. For tests and the reference comparison."""
    mean, std = np.asarray(plan.mean, np.float32), np.asarray(plan.std, np.float32)
    x = rows.astype(np.float32) / np.float32(255.0)
    if isinstance(plan.layout, FrameTiles):
        return ((x - mean) / std).transpose(0, 3, 1, 2)
    n = rows.shape[0]
    x = x.reshape(n, 3, -1)
    return ((x - mean[None, :, None]) / std[None, :, None]).reshape(n, -1)
