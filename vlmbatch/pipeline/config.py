"""The drive's part of the config tree: how stage 1 (reading, decoding, preparing images)
runs. ``PrepareConfig`` is the shared sub-config of every command that decodes images;
``PrepareOptions`` is it resolved for a device. The engine's configs are in
``engine/config.py``. Light by design: no torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from vlmbatch.engine.config import ConfigError
from vlmbatch.preprocessing.limits import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_PIXELS,
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


@dataclass(frozen=True)
class PrepareConfig:
    """Stage 1 of every command that decodes images (run and jobs, serve, embed, eval, the
    API): the shared sub-config of their config roots. ``preprocess_threads`` None: by
    device (``preprocess_threads_for``)."""
    max_pixels: int = DEFAULT_MAX_PIXELS  # larger images are that item's error (bomb guard)
    # decoder processes (threads with decode_timeout 0) decoding and tiling the next groups
    # while the model answers the current one; 0: none ahead; None: by device
    preprocess_threads: int | None = None
    # seconds one image may take to read, decode and tile before its worker (a decoder
    # process; a prepare task on Ray) is killed and that item fails; 0: no deadline, and
    # in-process decoding runs on threads of this process (a hang then stops the run)
    decode_timeout: float = 30.0
    # the fetch stage (http(s), s3/gs/az, table rows, shard members): reads at once, seconds
    # per attempt (connect; between two reads), more attempts on 429/5xx/connection errors
    fetch_concurrency: int = 32
    fetch_timeout: float = 30.0
    fetch_retries: int = 3
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # a larger encoded image: refused unread
    # the SSRF guard on http(s) fetches (a server's jobs: preprocessing/guard.py), and the
    # hosts it lets through (exact names; ".b.org" for b.org's subdomains)
    media_guard: bool = False
    allowed_media_domains: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_pixels < 1:
            raise ConfigError(f"max_pixels must be >= 1, got {self.max_pixels}")
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
                              self.decode_timeout, fetch=self.fetch)


def check_threads(threads: int | None, preprocess_threads: int | None) -> None:
    """ConfigError unless each count is None (the default) or in range."""
    if threads is not None and threads < 1:
        raise ConfigError(f"threads must be >= 1, got {threads}")
    if preprocess_threads is not None and preprocess_threads < 0:
        raise ConfigError(f"preprocess_threads must be >= 0, got {preprocess_threads}")


def preprocess_threads_for(given: int | None, device: str) -> int:
    """``given``, or by default 2 on CPU (where the model's torch threads want the cores:
    bench/prefetch.py on 2 cores, 1.10x for large JPEGs, 1.00x for small images) and up to 8
    on CUDA (the model leaves the CPU free, so decoding can take every core)."""
    if given is not None:
        return given
    if not device.startswith("cuda"):
        return 2
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(8, cores or 1)  # the cores this process may use, not the machine's
