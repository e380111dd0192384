"""Stage 1's limits and their defaults, apart from the decoder (``decode.py``: OpenCV,
Pillow, numpy) and the fetcher (``fetch.py``: httpx), so that the configs that default to
them (``jobs.config.RunConfig``, the server's) and the CLI's ``--help`` import none of
those."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_PIXELS = 100_000_000  # 100 MP: a 10000 x 10000 image
DEFAULT_MAX_VIDEO_SECONDS = 3600.0  # a clip longer than an hour is refused before decoding
DEFAULT_MAX_IMAGE_BYTES = 64 << 20  # an encoded image larger than this is refused unread
MAX_REDIRECTS = 5  # an http(s) fetch follows at most this many redirects
MAX_RETRY_AFTER_S = 60.0  # a Retry-After asking for longer fails the fetch at once


@dataclass(frozen=True)
class MediaGuard:
    """The SSRF guard of an http(s) fetch (``preprocessing/guard.py``): every connection's
    host resolved and refused if any address is loopback, private, link-local, ... unless
    the host is in ``allowed_domains`` (exact names, or ``.b.org`` for b.org's subdomains)."""
    allowed_domains: tuple[str, ...] = ()


@dataclass(frozen=True)
class FetchOptions:
    """How remote images (``http(s)://``, ``s3://``, ``gs://``, ``az://``) and images inside
    tables or shards are read (``preprocessing/fetch.py``): ``concurrency`` reads at once,
    each attempt given ``timeout_s`` (connect, and between two reads of the body), up to
    ``retries`` more attempts on 429, 5xx and connection errors, ``backoff_s`` x 2^k apart
    (or what ``Retry-After`` asks, up to ``MAX_RETRY_AFTER_S``); a body over ``max_bytes``
    is refused before it is read whole. ``guard``: the SSRF guard on every http(s)
    connection (and object stores refused); None: none (a user's own manifest may name its
    intranet)."""
    concurrency: int = 32
    timeout_s: float = 30.0
    retries: int = 3
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    backoff_s: float = 0.5
    guard: MediaGuard | None = None
