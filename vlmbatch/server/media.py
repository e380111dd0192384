"""A request's images: which URLs may be read (the media policy), and a chat image prepared.

The policy (``check_image_url``), checked before anything is read:

- ``data:`` URLs: always (the bytes travel in the request).
- ``file://`` URLs: only with ``--allowed-local-media-path DIR``, and only for a file whose
  real path (``..`` and symlinks resolved) is inside DIR; a host other than ``localhost``
  is refused, as is anything that is not a regular file.
- ``http(s)://``: only with ``--allow-remote-media``, and then fetched by the fetch stage
  under the SSRF guard (``preprocessing/guard.py``: every connection's host resolved and
  checked, redirects included, connected to the checked address). A chat request's host is
  also checked by its spelling here, before anything is queued (an internal IP literal, a
  numeric spelling); a batch line's is checked when it is fetched (that line's error).
- every other scheme, and bare paths: refused (a bare path would be read relative to the
  server's folder).

A request's clip (``video_url``) and each of its several images pass the same check
(``media_urls``: every URL an item reads).

The check parses a URL exactly as ``preprocessing.sources.read_bytes`` will read it
(``unquote(urlparse(url).path)``), so what is checked is what is read. A ``MediaRefused``
carries the reason; the server answers it with a 400.

A chat image is then paid for once (``MediaCache``, ``media_cache.py``): its bytes are read
(a ``data:`` URL's decoded on the event loop; a file or an http(s) image read on a worker
thread), and looked up by their content hash, the hit confirmed by comparing the bytes (as
the prefix cache confirms its keys), so the second and later requests about an image skip
its decode and tiling, and (the same ``PreparedImage``, hence the same cache key) the
engine's vision encoder and prefix prefill too.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from vlmbatch.pipeline.media_inputs import ImageList, VideoInput
from vlmbatch.preprocessing.guard import check_url_host
from vlmbatch.preprocessing.limits import MediaGuard
from vlmbatch.preprocessing.sources import SourceError


class MediaRefused(ValueError):
    """The URL may not be read by this server; the message says why and what to do."""


def check_image_url(url: str, allowed: Path | None, remote: MediaGuard | None = None,
                    hosts: bool = True) -> str:
    """``url`` if the server may read it, else ``MediaRefused``. A ``file://`` URL comes back
    as the ``file://`` URL of its resolved path (what was checked is what is read). An
    http(s) URL passes only with ``remote`` (``--allow-remote-media``), its host's spelling
    checked by the guard when ``hosts``."""
    if url.startswith("data:"):
        return url
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in ("http", "https") and remote is not None:
        if hosts:
            try:
                check_url_host(url, remote)
            except SourceError as e:
                raise MediaRefused(str(e)) from None
        return url
    if scheme in ("http", "https"):
        raise MediaRefused("http(s) image URLs are not fetched by this server (started "
                           "without --allow-remote-media); send the image inline as a data: URL "
                           "(data:image/png;base64,...)")
    if scheme != "file":
        raise MediaRefused("image_url.url must be a data: URL (or a file:// URL under the "
                           "server's --allowed-local-media-path)")
    if allowed is None:
        raise MediaRefused("file:// image URLs are refused: the server was not started with "
                           "--allowed-local-media-path; send a data: URL instead")
    return local_url(url, allowed)


def media_urls(media: object) -> list[str]:
    """The URLs an item's media reads, each to check: one image's, each of several images'
    (an ``ImageList``), a clip's (a ``VideoInput``)."""
    if isinstance(media, ImageList):
        return [str(u) for u in media.images]
    if isinstance(media, VideoInput):
        return [str(media.source)]
    return [str(media)]


def local_url(url: str, allowed: Path) -> str:
    """The resolved ``file://`` URL of ``url`` if it names a regular file inside
    ``allowed``."""
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise MediaRefused(f"file:// URL with host {parsed.netloc!r}: only local files "
                           "(file:///path) are read")
    raw = unquote(parsed.path)
    if "\x00" in raw:
        raise MediaRefused("file:// URL with a NUL byte in its path")
    root = Path(allowed).resolve()
    outside = MediaRefused("file:// URL outside --allowed-local-media-path (after resolving "
                           "'..' and symlinks): refused")
    given = Path(os.path.normpath(os.path.abspath(allowed)))  # as typed: may hold a symlink
    lexical = Path(os.path.normpath(raw))
    if not raw.startswith("/") or not (lexical.is_relative_to(root)
                                       or lexical.is_relative_to(given)):
        raise outside  # decided before touching the file system: no probing outside the root
    try:
        path = Path(raw).resolve(strict=True)
    except (OSError, RuntimeError):  # missing, or a symlink loop
        raise MediaRefused("file:// URL names no readable file under "
                           "--allowed-local-media-path") from None
    if not path.is_relative_to(root):
        raise outside
    if not path.is_file():
        raise MediaRefused("file:// URL does not name a regular file")
    return path.as_uri()


