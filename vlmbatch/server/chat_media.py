"""A chat request's several images or clip, prepared for the engines (issue 44's server
door). Which parts a request holds, their limits and the sampling keys are read with the
batch lines' reader (``inputs/chat_media.py``); this module makes the prepared item.

- Several ``image_url`` parts (an ``ImageList``): each image prepared as a lone chat image
  is (``chat.Chat.image``: the media cache, one decode for concurrent requests), all at
  once, joined in order into one ``MediaItem``, the prompt a manifest's ``"images"`` makes.
  A part that fails is the request's 400, its message naming the part (``image_url part 2
  of 3: ...``).
- One ``video_url`` part (a ``VideoInput``): the URL checked by the images' policy
  (``media.check_image_url``: ``data:`` always, ``file://`` under
  ``--allowed-local-media-path``, http(s) with ``--allow-remote-media`` under the SSRF
  guard), its bytes read on a worker thread, then sampled and prepared in one of the
  server's decoder processes as a batch's clip is (``VideoSource`` with the engine's
  ``VideoPlan`` under the request's ``mm_processor_kwargs``; ``--decode-timeout`` applies).
  Bad bytes (not a clip, truncated, too few frames for the sampling asked...) are the
  request's 400 naming the part; the server goes on. Clips are not kept in the media cache:
  the engine's feature cache (per frame group) and prefix cache still spare a repeated
  clip its vision encoder and prefill.

The pydantic models of a ``video_url`` part are here too (``chat.ChatRequest`` takes them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from vlmbatch.engine.records import MediaItem
from vlmbatch.pipeline.media_inputs import ImageList, VideoInput
from vlmbatch.pipeline.preparers import prepare_now
from vlmbatch.pipeline.task import ImageRef
from vlmbatch.preprocessing.decode import ImageError, ImageTooLarge
from vlmbatch.preprocessing.isolated import DecoderCrashed, DecodeTimeout
from vlmbatch.preprocessing.prepare import PreparedImage
from vlmbatch.preprocessing.sources import SourceError, read_bytes
from vlmbatch.preprocessing.video_plan import VideoPlan
from vlmbatch.preprocessing.video_source import VideoSource
from vlmbatch.server.errors import STRICT, bad_request
from vlmbatch.server.media import MediaRefused, check_image_url
from vlmbatch.server.media_cache import MediaCache
from vlmbatch.serving.errors import APIError

PARAM = "messages"
ROOT_DIR = Path("/")  # base folder: unused (bare paths are refused before reading)
CLIP = "video_url part"


class VideoURL(BaseModel):
    model_config = STRICT
    url: str


class VideoPart(BaseModel):
    """``{"type": "video_url", "video_url": {"url": ...}}``, as vLLM takes a clip."""
    model_config = STRICT
    type: Literal["video_url"]
    video_url: VideoURL


ImageOf = Callable[[str], Awaitable[PreparedImage]]


async def prepare_media(media: ImageList | VideoInput, image: ImageOf, images: MediaCache,
                        plan: VideoPlan | None) -> MediaItem:
    """The ``MediaItem`` of a request's several images (each by ``image``, the chat
    image path) or of its clip (by ``plan``, the engine's; None: this model takes no
    clips, a 400); an ``APIError`` naming the part otherwise."""
    if isinstance(media, ImageList):
        return await _images(media, image)
    if plan is None:
        raise bad_request(f"{CLIP}: this model takes no clips (its family has no video "
                          "plan); send image_url parts", PARAM, "unsupported_media")
    return await run_in_threadpool(_clip, media, images, plan)


async def _images(media: ImageList, image: ImageOf) -> MediaItem:
    urls = [str(u) for u in media.images]
    got = await asyncio.gather(*(image(u) for u in urls), return_exceptions=True)
    for k, g in enumerate(got):
        if isinstance(g, APIError):
            raise APIError(g.status, f"image_url part {k + 1} of {len(urls)}: {g.message}",
                           g.param, g.code) from None
        if isinstance(g, BaseException):
            raise g
    return MediaItem(tuple(g for g in got if isinstance(g, PreparedImage)))


def _clip(v: VideoInput, images: MediaCache, plan: VideoPlan) -> MediaItem:
    """Read, sample and prepare the clip (a worker thread; the decode in a decoder
    process)."""
    data = _read(str(v.source), images)
    keys = v.sampling
    source = VideoSource(data, plan.with_sampling(keys.fps, keys.num_frames, keys.max_frames))
    try:
        item = prepare_now(ImageRef(source, ROOT_DIR, CLIP), images.plan, images.opts,
                           images.workers)
    except SourceError as e:
        raise bad_request(f"{CLIP}: the clip could not be read: {e}", PARAM,
                          "invalid_video_url") from None
    except ImageTooLarge as e:
        raise bad_request(f"{CLIP}: the clip is too large: {e}", PARAM,
                          "video_too_large") from None
    except (DecodeTimeout, DecoderCrashed) as e:
        code = "decode_timeout" if isinstance(e, DecodeTimeout) else "decoder_crashed"
        raise bad_request(f"{CLIP}: the clip could not be decoded: {e}", PARAM, code) from None
    except ImageError as e:  # VideoError: not a clip, truncated, too short, no frames...
        raise bad_request(f"{CLIP}: the clip could not be decoded: {e}", PARAM,
                          "invalid_video") from None
    assert isinstance(item, MediaItem)
    return item


def _read(url: str, images: MediaCache) -> bytes:
    """The clip's bytes, its URL checked by the images' policy first (a 400 naming the
    part when refused, unreadable or empty)."""
    try:
        checked = check_image_url(url, images.allowed, images.remote)
    except MediaRefused as e:
        raise bad_request(f"{CLIP}: {e}", PARAM, "invalid_video_url") from None
    try:
        data = (images.fetcher.fetch(checked, ROOT_DIR) if images.fetcher.needs(checked)
                else read_bytes(checked, ROOT_DIR))
    except SourceError as e:
        raise bad_request(f"{CLIP}: the clip could not be read: {e}", PARAM,
                          "invalid_video_url") from None
    if not data:
        raise bad_request(f"{CLIP}: the clip is empty", PARAM, "invalid_video")
    return data
