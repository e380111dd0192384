"""The OpenAI Batch API file format for embeddings, read (a job of these requests:
``jobs/tasks.py`` ``RequestTask``; their output lines: ``outputs/lines.py``).

Input line (one embeddings request)::

    {"custom_id": "r1", "method": "POST", "url": "/v1/embeddings",
     "body": {"model": "...", "input": "a red circle" | ["a red circle", ...],
              "encoding_format": "float" | "base64", "dimensions": 64}}

A request is one job item (``EmbedRequestItem``), whatever the length of its ``input``: its
strings are embedded in the order given, in the group the item falls in, and recorded
together, so the request is answered (or fails) whole, exactly once, and ``request_counts``
count requests. Its results are one ``Embedding`` per string (``index``: the string's place
in ``input``, ``id``: the request's ``custom_id``). Vectors are stored at the model's full
size; ``dimensions`` (a Matryoshka size of the checkpoint: truncate, then re-normalise, as
``/v1/embeddings`` does) and ``encoding_format`` apply when the output line is written.

Token-id inputs (arrays of integers) are refused: the embedder builds its prompts from text.
Every line is checked as read (``iter_embed_requests``): a bad one names its line. Tokens
are counted by the embedder, so the token limits of ``/v1/embeddings`` (8,192 per string,
300,000 per request) fail a request when it is embedded (``too_large_error``:
``limited``).

Output lines: ``outputs/lines.py``; the task of a job of requests: ``jobs/tasks.py``
``RequestTask``.

Light (no torch, no image decoding): ``vlmbatch results`` of such a job and the server's
batch worker read and write these lines without the model's stack.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from vlmbatch.inputs.errors import check_unicode
from vlmbatch.pipeline.questions import ManifestError, brief, check_id
from vlmbatch.pipeline.records import EmbedItem

URL = "/v1/embeddings"
BODY_KEYS = {"model", "input", "encoding_format", "dimensions", "user"}
# as /v1/embeddings takes them: strings per request, tokens per string and per request
MAX_INPUTS, MAX_INPUT_TOKENS, MAX_REQUEST_TOKENS = 2048, 8192, 300_000
ENCODINGS = ("float", "base64")


class LineError(ValueError):
    """What is wrong with one line (its message names no file or line)."""


@dataclass(frozen=True)
class EmbedRequestItem:
    """One embeddings request of a batch file: a job item of ``texts`` embedded together."""
    custom_id: str
    texts: tuple[str, ...]
    dimensions: int | None = None  # None: the model's full size
    encoding_format: str = "float"  # one of ENCODINGS

    @property
    def source(self) -> str:
        """How messages name the request (the Ray executor's, for a failed prepare task)."""
        return f"request {self.custom_id}"

    def inputs(self) -> list[EmbedItem]:
        return [EmbedItem(i, None, None, t, Path("/")) for i, t in enumerate(self.texts)]

    def to_json(self) -> str:
        """As a job store keeps it (``custom_id`` first: ``is_request_json`` reads that)."""
        return json.dumps({"custom_id": self.custom_id, "texts": list(self.texts),
                           "dimensions": self.dimensions,
                           "encoding_format": self.encoding_format}, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> EmbedRequestItem:
        d = json.loads(text)
        return cls(d["custom_id"], tuple(d["texts"]), d["dimensions"], d["encoding_format"])


def is_request_json(text: str) -> bool:
    """Whether a stored item is an ``EmbedRequestItem`` (else an ``EmbedItem``)."""
    return text.startswith('{"custom_id":')


def parse_embed_request(rec: dict) -> EmbedRequestItem:
    """One batch line's request, checked; ``LineError`` saying what is wrong."""
    if "custom_id" not in rec:
        raise LineError("missing 'custom_id' (each line needs custom_id, method, url, body)")
    url = rec.get("url")
    if url != URL:
        raise LineError(f"url {brief(url)} does not match the batch's endpoint {URL}; each "
                        "endpoint's requests go in a batch of their own")
    if rec.get("method", "POST") != "POST":
        raise LineError(f"method must be 'POST', got {brief(rec.get('method'))}")
    unknown = sorted(set(rec) - {"custom_id", "method", "url", "body"}, key=str)
    if unknown:
        raise LineError(f"unknown key(s) {brief(unknown)}; a line has custom_id, method, url "
                        "and body")
    try:
        cid = check_id(rec["custom_id"], "", "custom_id")
    except ManifestError as e:
        raise LineError(str(e).removeprefix(": ")) from None
    body = rec.get("body")
    if not isinstance(body, dict):
        raise LineError(f"body must be an object, got {brief(body)}")
    unknown = sorted(set(body) - BODY_KEYS, key=str)
    if unknown:
        raise LineError(f"body has unknown key(s) {brief(unknown)}; an embeddings body has "
                        f"{sorted(BODY_KEYS)} (text inputs only)")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise LineError(f"body.model must be a non-empty string, got {brief(body.get('model'))}")
    fmt = body.get("encoding_format", "float")
    if fmt not in ENCODINGS:
        raise LineError(f"body.encoding_format must be 'float' or 'base64', got {brief(fmt)}")
    dims = body.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        raise LineError(f"body.dimensions must be a whole number >= 1, got {brief(dims)}")
    texts = _texts(body.get("input"))
    try:
        check_unicode([cid, *texts], "")
    except ManifestError as e:
        raise LineError(str(e).removeprefix(": ")) from None
    return EmbedRequestItem(cid, texts, dims, fmt)


def _texts(raw: object) -> tuple[str, ...]:
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise LineError(f"body.input must be a string or a non-empty list of strings, got "
                        f"{brief(raw)}")
    if all(_ids(x) for x in raw) or all(isinstance(x, list) and _ids(*x) for x in raw):
        raise LineError("body.input: token-id inputs are not supported by this server; send "
                        "the text")
    if len(raw) > MAX_INPUTS:
        raise LineError(f"body.input has {len(raw):,} strings, over the limit of {MAX_INPUTS:,}")
    for i, x in enumerate(raw):
        if not isinstance(x, str) or not x.strip():
            raise LineError(f"body.input[{i}] must be a non-empty string, got {brief(x)}")
    return tuple(raw)


def _ids(*xs: object) -> bool:
    return bool(xs) and all(isinstance(x, int) and not isinstance(x, bool) for x in xs)


def iter_embed_requests(path: Path, on_error: Callable[[int, str], None] | None = None
                        ) -> Iterator[tuple[int, EmbedRequestItem]]:
    """(line number, request) per line, checked as read, in bounded memory. A bad line
    raises ``ManifestError`` naming it, or with ``on_error`` is handed to it (line, message)
    and skipped. A repeated ``custom_id`` is the caller's check (the job store's key)."""
    path = Path(path)
    if not path.is_file():
        raise ManifestError(f"manifest {path} not found")
    n = 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                req = _line(raw, lineno)
            except LineError as e:
                if on_error is None:
                    raise ManifestError(f"{path}:{lineno}: {e}") from None
                on_error(lineno, str(e))
                continue
            if req is not None:
                n += 1
                yield lineno, req
    if not n and on_error is None:
        raise ManifestError(f"manifest {path} has no requests")


def _line(raw: bytes, lineno: int) -> EmbedRequestItem | None:
    try:
        line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
    except UnicodeDecodeError as e:
        raise LineError(f"not UTF-8 ({e.reason} at byte {e.start})") from None
    if not line.strip():
        return None
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError) as e:
        raise LineError(f"not valid JSON ({type(e).__name__})") from None
    if not isinstance(rec, dict):
        raise LineError("each line must be a JSON object")
    return parse_embed_request(rec)
