"""The drive's part of the config tree: how stage 1 (reading, decoding, preparing images)
runs. ``PrepareConfig`` is the shared sub-config of every command that decodes images, its
fields declaring their options (``common/options.py``); ``PrepareOptions`` is it resolved for
a device. The engine's configs are in ``engine/config.py``. Light by design: no torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

from vlmbatch.common.options import COUNT, MIB, N0, NOT_STORED, SECONDS, BadValue, N, opt
from vlmbatch.engine.config import ConfigError
from vlmbatch.pipeline.media_inputs import SamplingKeys, check_sampling
from vlmbatch.preprocessing.limits import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_PIXELS,
    DEFAULT_MAX_VIDEO_SECONDS,
    FetchOptions,
    MediaGuard,
)


@dataclass(frozen=True)
class PrepareOptions:
    """How stage 1 runs, resolved (``PrepareConfig.options``): images over ``max_pixels`` are
    that item's error; ``threads`` preprocessing workers prepare the next ``ahead`` groups
    while the model answers (0: each group when asked for, in the caller's thread);
    ``decode_timeout > 0``: the workers are decoder processes and each image has that many
    seconds (else threads, no deadline); remote images, table rows and shard members are
    read by a fetch stage ahead of them, as ``fetch`` says."""
    max_pixels: int = DEFAULT_MAX_PIXELS
    threads: int = 2
    decode_timeout: float = 0.0
    ahead: int = 2
    fetch: FetchOptions = FetchOptions()
    sampling: SamplingKeys = SamplingKeys()  # a clip's, where its item gives none
    max_video_seconds: float = DEFAULT_MAX_VIDEO_SECONDS  # a longer clip: its item's error


def domain_list(text: str) -> tuple[str, ...]:
    """argparse type: ``a.com,.b.org,127.0.0.1`` -> its entries, lower case, checked."""
    out = []
    for entry in (e.strip().lower() for e in text.split(",")):
        host = entry.removeprefix(".")
        if not host or any(c in host for c in "/@?#\\ ") or "://" in entry:
            raise BadValue(f"{entry!r} is not a host name (a.com, .b.org)")
        out.append(entry)
    return tuple(out)


@dataclass(frozen=True)
class PrepareConfig:
    """Stage 1 of every command that decodes images (run and jobs, serve, embed, eval, the
    API): the shared sub-config of their config roots. ``preprocess_threads`` None: by
    device (``preprocess_threads_for``)."""
    OPTION_GROUP: ClassVar[str] = "images"
    # larger images are that item's error (bomb guard)
    max_pixels: int = field(default=DEFAULT_MAX_PIXELS, metadata=opt(
        "--max-pixels", unit=COUNT, metavar="PIXELS", help="images with more pixels (read from "
        "the header) are that item's error; serve: a 400 (default %(default)s)"))
    # decoder processes (threads with decode_timeout 0) decoding and tiling the next groups
    # while the model answers the current one; 0: none ahead; None: by device
    preprocess_threads: int | None = field(default=None, metadata=opt(
        "--preprocess-threads", unit=N0, show=lambda v: "2 on CPU, up to 8 on CUDA",
        help="decoder processes (threads with --decode-timeout 0) decoding and tiling the "
        "next image groups while the model answers the current one, in-process (Ray: "
        "--preprocess-workers); 0: none ahead (one decoder process, or this thread) "
        "(default: %(default)s)"))
    # seconds one image may take to read, decode and tile before its worker (a decoder
    # process; a prepare task on Ray) is killed and that item fails; 0: no deadline, and
    # in-process decoding runs on threads of this process (a hang then stops the run)
    decode_timeout: float = field(default=30.0, metadata=opt(
        "--decode-timeout", unit=SECONDS, help="seconds one image may take to read and decode "
        "before its worker (a decoder process, or a Ray prepare task) is killed and that item "
        "fails (serve: a request's 400, a batch line's error) (default %(default)s); 0: no "
        "limit, and decoding runs on threads of this process, where a hung or crashing "
        "decoder stops the run"))
    # the fetch stage (http(s), s3/gs/az, table rows, shard members): reads at once, seconds
    # per attempt (connect; between two reads), more attempts on 429/5xx/connection errors
    fetch_concurrency: int = field(default=32, metadata=opt(
        "--fetch-concurrency", unit=N, group="fetching", help="remote images (http(s)://, "
        "s3://, gs://, az://), table rows and shard members read at once, ahead of decoding "
        "(default %(default)s)"))
    fetch_timeout: float = field(default=30.0, metadata=opt(
        "--fetch-timeout", unit=SECONDS, group="fetching", help="seconds a fetch attempt may "
        "wait to connect or between two reads (default %(default)s); apart from "
        "--decode-timeout"))
    fetch_retries: int = field(default=3, metadata=opt(
        "--fetch-retries", unit=N0, group="fetching", help="more attempts after a 429, a 5xx "
        "or a connection error, backing off (Retry-After honoured up to 60 s) (default "
        "%(default)s)"))
    # a larger encoded image: refused unread
    max_image_bytes: int = field(default=DEFAULT_MAX_IMAGE_BYTES, metadata=opt(
        "--max-image-mib", unit=MIB, group="fetching", help="an encoded image larger than this "
        "many MiB is that item's error, refused before it is read whole (default "
        "%(default)s)"))
    # the SSRF guard on http(s) fetches (a server's jobs: preprocessing/guard.py), and the
    # hosts it lets through (exact names; ".b.org" for b.org's subdomains)
    media_guard: bool = False
    allowed_media_domains: tuple[str, ...] = field(default=(), metadata=opt(
        "--allowed-media-domains", parse=domain_list, metavar="HOST,HOST", group="server",
        help="serve --allow-remote-media: hosts the SSRF guard lets through whatever they "
        "resolve to (exact names or addresses; .b.org for b.org's subdomains)"))

    # clips: the run's sampling keys (an item's own win); None: the checkpoint's. A job folds
    # them into its items at submit (``jobs/tasks.py``), so job.json does not keep them
    fps: float | None = field(default=None, metadata={**opt(
        "--fps", parse=float, metavar="FACTOR", group="video", help="frames per second "
        "sampled from each clip (default: the checkpoint's video processor's; a line's 'fps' "
        "wins)"),
        NOT_STORED: True})
    num_frames: int | None = field(default=None, metadata={**opt(
        "--num-frames", unit=N, group="video", help="frames sampled from each clip, evenly "
        "(instead of --fps; a line's 'num_frames' wins)"), NOT_STORED: True})
    max_frames: int | None = field(default=None, metadata={**opt(
        "--max-frames", unit=N, group="video", help="at most this many frames per clip (a "
        "line's 'max_frames' wins)"), NOT_STORED: True})
    max_video_tokens: int | None = field(default=None, metadata={**opt(
        "--max-video-tokens", unit=N, group="video", help="at most this many visual tokens "
        "per clip: Qwen-VL's frames are made smaller (the video processor's max_pixels), "
        "InternVL's frames fewer; a clip that cannot fit is its item's error (a line's "
        "'max_video_tokens' wins; default: no budget)"), NOT_STORED: True})
    # a longer clip is its item's error (``too_large``), refused before a frame is decoded;
    # kept in job.json (a file without it reads the default), so a resumed job refuses as
    # it was submitted to
    max_video_seconds: float = field(default=DEFAULT_MAX_VIDEO_SECONDS, metadata=opt(
        "--max-video-seconds", unit=SECONDS, group="video", help="clips longer than this "
        "many seconds are that item's error, refused before any frame is decoded (default "
        "%(default)s)"))
    segment_seconds: float | None = field(default=None, metadata={**opt(
        "--segment-seconds", parse=float, metavar="SECONDS", group="video", help="ask each clip "
        "in windows of SECONDS, each sampled as a clip, with a line per window and one per "
        "question for the clip (the most probable window's answer; a line's wins)"),
        NOT_STORED: True})
    segment_stride: float | None = field(default=None, metadata={**opt(
        "--segment-stride", parse=float, metavar="SECONDS", group="video", help="seconds between "
        "window starts (default: --segment-seconds; half of it: windows overlapping by "
        "half)"), NOT_STORED: True})

    def __post_init__(self) -> None:
        try:
            check_sampling({"fps": self.fps, "num_frames": self.num_frames,
                            "max_frames": self.max_frames,
                            "max_video_tokens": self.max_video_tokens,
                            "segment_seconds": self.segment_seconds,
                            "segment_stride": self.segment_stride}, "video sampling")
        except ValueError as e:
            raise ConfigError(str(e).replace("video sampling: ", "--").replace(
                "_", "-")) from None
        if self.max_pixels < 1:
            raise ConfigError(f"max_pixels must be >= 1, got {self.max_pixels}")
        if not self.max_video_seconds > 0:  # NaN too
            raise ConfigError(f"--max-video-seconds must be > 0, got {self.max_video_seconds}")
        check_threads(None, self.preprocess_threads)
        if not self.decode_timeout >= 0:  # NaN too
            raise ConfigError(f"--decode-timeout must be >= 0, got {self.decode_timeout}")
        if self.fetch_concurrency < 1 or self.fetch_retries < 0:
            raise ConfigError("--fetch-concurrency must be >= 1 and --fetch-retries >= 0")
        if not self.fetch_timeout > 0:
            raise ConfigError(f"--fetch-timeout must be > 0, got {self.fetch_timeout}")
        if self.max_image_bytes < 1:
            raise ConfigError(f"--max-image-mib must be > 0, got {self.max_image_bytes >> 20}")

    @property
    def fetch(self) -> FetchOptions:
        guard = MediaGuard(self.allowed_media_domains) if self.media_guard else None
        return FetchOptions(self.fetch_concurrency, self.fetch_timeout, self.fetch_retries,
                            self.max_image_bytes, guard=guard)

    def options(self, device: str) -> PrepareOptions:
        """Resolved for a model on ``device``."""
        return PrepareOptions(self.max_pixels,
                              preprocess_threads_for(self.preprocess_threads, device),
                              self.decode_timeout, fetch=self.fetch,
                              sampling=SamplingKeys(self.fps, self.num_frames, self.max_frames,
                                                    self.max_video_tokens, self.segment_seconds,
                                                    self.segment_stride),
                              max_video_seconds=self.max_video_seconds)


def check_threads(threads: int | None, preprocess_threads: int | None) -> None:
    """ConfigError unless each count is None (the default) or in range."""
    if threads is not None and threads < 1:
        raise ConfigError(f"threads must be >= 1, got {threads}")
    if preprocess_threads is not None and preprocess_threads < 0:
        raise ConfigError(f"preprocess_threads must be >= 0, got {preprocess_threads}")


def preprocess_threads_for(given: int | None, device: str) -> int:
    """``given``, or by default 2 on CPU (where the model's torch threads want the cores:
    bench/prefetch.py on 2 cores: docs/figures.md#prefetch) and up to 8
    on CUDA (the model leaves the CPU free, so decoding can take every core)."""
    if given is not None:
        return given
    if not device.startswith("cuda"):
        return 2
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(8, cores or 1)  # the cores this process may use, not the machine's
