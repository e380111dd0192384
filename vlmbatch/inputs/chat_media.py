"""What a chat request's content parts ask about, as vLLM accepts them: the item's media.

Read for an OpenAI batch line (``openai_batch.parse_request``: ``vlmbatch run``/``submit``
on a batch file, the server's ``/v1/batches``) and for a ``POST /v1/chat/completions``
(which reads its body as a batch line), from the user messages' parts in order:

- one ``image_url`` part: that image (as before);
- several ``image_url`` parts: ONE item, the images in order in one prompt (an
  ``ImageList``, what a manifest's ``"images"`` makes), at most ``MAX_IMAGES``;
- one ``video_url`` part (``{"type": "video_url", "video_url": {"url": ...}}``): a clip
  (a ``VideoInput``), sampled by the body's ``mm_processor_kwargs`` (vLLM's field:
  ``fps``, ``num_frames``, ``max_frames``; checked as a manifest line's keys are,
  ``media_inputs.check_sampling``), else by the run's and the checkpoint's settings.
  At most ``MAX_CLIPS`` clip per item, and not beside images (an item is images or a clip).

A request holds at most ``MAX_PARTS`` content parts in all (text parts included), so a
huge list is refused before anything is read. Every refusal is a ``PartsError`` (a
``ManifestError``) whose ``param`` names the request field at fault (``messages`` or
``mm_processor_kwargs``), its message the part, the limit and what to do.

Light: no decoder, no torch.
"""

from __future__ import annotations

from vlmbatch.pipeline.media_inputs import (
    MAX_IMAGES,
    SAMPLING_KEYS,
    ImageList,
    SamplingKeys,
    VideoInput,
    check_sampling,
)
from vlmbatch.pipeline.questions import ManifestError, brief

MAX_PARTS = 256  # content parts of one request, all messages and kinds together
MAX_CLIPS = 1  # video_url parts of one request: one clip per item
KWARGS = "mm_processor_kwargs"  # vLLM's request field for the processor's settings
Media = str | ImageList | VideoInput


class PartsError(ManifestError):
    """A request's parts or sampling settings refused; ``param``: the request field."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


def media_of(parts: list[tuple[str, str]], body: dict, where: str) -> Media:
    """The item's media from a request's user parts, ``(kind, value)`` in order (``kind``
    ``text``, ``image_url`` or ``video_url``), and its body (``mm_processor_kwargs``):
    one image's URL, an ``ImageList`` of several, or a ``VideoInput``; ``PartsError``
    naming ``where`` and the limit otherwise."""
    if len(parts) > MAX_PARTS:
        raise PartsError(f"{where}: {len(parts)} content parts, over the limit of "
                         f"{MAX_PARTS} per request")
    images = [u for k, u in parts if k == "image_url"]
    clips = [u for k, u in parts if k == "video_url"]
    keys = sampling_of(body, where)
    if len(clips) > MAX_CLIPS:
        raise PartsError(f"{where}: {len(clips)} video_url parts; a request takes at most "
                         f"{MAX_CLIPS} clip (one clip per item): send one request per clip")
    if clips and images:
        raise PartsError(f"{where}: a request holds image_url parts or one video_url part, "
                         "not both; ask about the clip and the images in separate requests")
    if clips:
        return VideoInput(clips[0], keys or SamplingKeys())
    if keys is not None:
        raise PartsError(f"{where}: body.{KWARGS} ({', '.join(SAMPLING_KEYS)}) samples a "
                         "clip: it needs a video_url part", KWARGS)
    if not images:
        raise PartsError(f"{where}: each request needs an image_url or a video_url part, "
                         "found none")
    if len(images) > MAX_IMAGES:
        raise PartsError(f"{where}: {len(images)} image_url parts, over the limit of "
                         f"{MAX_IMAGES} images per request (one prompt); split the request, "
                         "or send a clip (video_url)")
    return images[0] if len(images) == 1 else ImageList(tuple(images))


def sampling_of(body: dict, where: str) -> SamplingKeys | None:
    """The body's ``mm_processor_kwargs`` as sampling keys (None: absent); ``PartsError``
    (param ``mm_processor_kwargs``) for an unknown key or a bad value, naming it."""
    raw = body.get(KWARGS)
    if raw is None or raw == {}:
        return None
    at = f"{where}: body.{KWARGS}"
    if not isinstance(raw, dict):
        raise PartsError(f"{at} must be an object ({{\"fps\": 2}}), got {brief(raw)}", KWARGS)
    unknown = sorted(str(k) for k in raw if k not in SAMPLING_KEYS)
    if unknown:
        raise PartsError(f"{at}: unknown key(s) {', '.join(map(repr, unknown))}; this server "
                         f"reads {', '.join(SAMPLING_KEYS)}", KWARGS)
    try:
        return check_sampling(raw, at)
    except ValueError as e:
        raise PartsError(str(e), KWARGS) from None
