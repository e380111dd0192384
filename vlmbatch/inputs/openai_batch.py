"""The OpenAI Batch API file format for chat requests, read (its output lines:
``outputs/lines.py``).

Input line (one chat completion request)::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [{"role": "user", "content": [
         {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
         {"type": "text", "text": "Is there a red shape?"}]}]}}

Each request becomes one item with one question (its text parts joined) about its media: one
``image_url`` part, several (one prompt, in order), or one ``video_url`` part sampled by
``mm_processor_kwargs`` (``chat_media.py``: the parts, their limits and the sampling keys).
Every key is checked, at every level: the line's (``custom_id``, ``method``, ``url``,
``body``), the body's (the parameters OpenAI's chat completions define, plus vLLM's
label-set names and ``mm_processor_kwargs``; sampling ones are ignored, answers being
greedy), a message's (by its role), a user content part's (``text``, ``image_url`` or
``video_url`` parts only) and an ``image_url``/``video_url`` object's: an unknown one is
refused naming it, never ignored. ``file://`` and ``data:`` URLs and local paths are read;
http(s) (and s3/gs/az) URLs are fetched by the fetch stage, a failure that item's ``source``
error (``docs/data_sources.md``; the server refuses them unless ``--allow-remote-media``).
Requests for the same image share its prefix cache entry, keyed by pixel content. A body
with vLLM's ``structured_outputs: {"choice": [...]}`` (or ``guided_choice: [...]``, its
older name) asks a label-set question: the answer is the most probable choice
(``Question.choices``).

Output lines: ``outputs/lines.py``.
"""

from __future__ import annotations

from pathlib import Path

from vlmbatch.inputs.chat_media import KWARGS, media_of
from vlmbatch.pipeline.questions import (
    ManifestError,
    Question,
    brief,
    check_id,
    check_keys,
    parse_choices,
)
from vlmbatch.pipeline.records import ImageItem

REQUEST_KEYS = frozenset({"custom_id", "method", "url", "body"})
# the request body parameters of OpenAI's chat completions (read: model, messages, the token
# counts; the rest accepted and ignored), and vLLM's two names of a label set
BODY_KEYS = frozenset({
    "model", "messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
    "temperature", "top_p", "seed", "n", "stop", "stream", "stream_options", "user",
    "frequency_penalty", "presence_penalty", "logit_bias", "response_format", "tools",
    "tool_choice", "parallel_tool_calls", "functions", "function_call", "metadata", "store",
    "service_tier", "reasoning_effort", "modalities", "audio", "prediction", "verbosity",
    "web_search_options", "prompt_cache_key", "safety_identifier",
    "structured_outputs", "guided_choice", KWARGS})
_TURN = frozenset({"role", "content", "name"})
MESSAGE_KEYS = {"system": _TURN, "developer": _TURN, "user": _TURN,
                "assistant": _TURN | {"tool_calls", "refusal", "audio", "function_call"},
                "tool": _TURN | {"tool_call_id"}}
PART_KEYS = {"text": frozenset({"type", "text"}), "image_url": frozenset({"type", "image_url"}),
             "video_url": frozenset({"type", "video_url"})}  # several media: chat_media.py
URL_KEYS = frozenset({"url", "detail"})


def is_openai_request(rec: dict) -> bool:
    return "custom_id" in rec and "body" in rec


def parse_request(rec: dict, where: str, base_dir: Path) -> ImageItem:
    check_keys(rec, REQUEST_KEYS, where, "a batch request line")
    if rec.get("url", "/v1/chat/completions") != "/v1/chat/completions":
        also = ("; embedding requests go in a file of their own (a batch with endpoint "
                "/v1/embeddings, or `submit --task embed`)" if rec.get("url") ==
                "/v1/embeddings" else "")
        raise ManifestError(f"{where}: url {brief(rec.get('url'))} is not supported; "
                            f"only /v1/chat/completions{also}")
    if rec.get("method", "POST") != "POST":
        raise ManifestError(f"{where}: method must be 'POST', got {brief(rec.get('method'))}")
    body = rec["body"]
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ManifestError(f"{where}: body.messages must be a non-empty list")
    check_keys(body, BODY_KEYS, where, "a chat completion body (OpenAI's parameters; those "
               "that sample are ignored: answers are greedy)", "body ")
    parts = [p for i, msg in enumerate(messages)
             for p in _user_parts(msg, f"body.messages[{i}]", where)]
    image = media_of(parts, body, where)
    texts = [value for kind, value in parts if kind == "text"]
    question = " ".join(t.strip() for t in texts if t.strip())
    if not question:
        raise ManifestError(f"{where}: no text part to ask")
    return ImageItem(check_id(rec["custom_id"], where, "custom_id"), image,
                     (Question("q0", question, max_new_tokens=_answer_tokens(rec, where),
                               choices=_choices(body, where)),), base_dir)


def _user_parts(msg: object, name: str, where: str) -> list[tuple[str, str]]:
    """("text", text), ("image_url", url) and ("video_url", url) of a user message's
    content, in order; none for another role's (system and assistant turns carry no image or
    question here). Its keys, its parts' and their ``image_url``'s are checked."""
    if not isinstance(msg, dict):
        raise ManifestError(f"{where}: {name} must be an object, got {brief(msg)}")
    role = msg.get("role")
    if not isinstance(role, str) or role not in MESSAGE_KEYS:
        raise ManifestError(f"{where}: {name}.role must be one of {sorted(MESSAGE_KEYS)}, got "
                            f"{brief(role)}")
    check_keys(msg, MESSAGE_KEYS[role], where, f"a {role} message", f"{name} ")
    content = msg.get("content")
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if role != "user" or not isinstance(parts, list):
        return []
    out = []
    for j, part in enumerate(parts):
        at = f"{name}.content[{j}]"
        if not isinstance(part, dict):
            raise ManifestError(f"{where}: {name} has a content part that is not an object: "
                                f"{brief(part)}")
        kind = part.get("type")
        if not isinstance(kind, str) or kind not in PART_KEYS:
            raise ManifestError(f"{where}: {at}.type must be 'text', 'image_url' or "
                                f"'video_url', got {brief(kind)}")
        check_keys(part, PART_KEYS[kind], where, f"a {kind} part", f"{at} ")
        value = part.get(kind)
        if isinstance(value, dict):  # {"url": ..., "detail": ...}
            check_keys(value, URL_KEYS if kind == "image_url" else {"url"}, where,
                       f"a {kind} object", f"{at}.{kind} ")
            value = value.get("url")
        if not isinstance(value, str) or (kind != "text" and not value):
            what = "a string" if kind == "text" else "a url"
            raise ManifestError(f"{where}: {at} needs {what}, got {brief(value)}")
        out.append((kind, value))
    return out


def _choices(body: dict, where: str) -> tuple[str, ...]:
    """The label set of ``structured_outputs.choice`` (vLLM) or ``guided_choice`` (its older
    name), () for neither; ManifestError for another kind of structured output, or two
    different lists."""
    so = body.get("structured_outputs")
    if so is not None and (not isinstance(so, dict) or set(so) != {"choice"}):
        raise ManifestError(f"{where}: body.structured_outputs supports only "
                            f'{{"choice": [...]}} (a label set), got {brief(so)}')
    given = [(name, v) for name, v in (("structured_outputs.choice", (so or {}).get("choice")),
                                       ("guided_choice", body.get("guided_choice")))
             if v is not None]
    if len(given) == 2 and given[0][1] != given[1][1]:
        raise ManifestError(f"{where}: body.structured_outputs.choice and body.guided_choice "
                            "differ; give one")
    if not given:
        return ()
    return parse_choices(given[0][1], f"{where}: body.{given[0][0]}")


def _answer_tokens(rec: dict, where: str) -> int | None:
    """``max_completion_tokens`` (else ``max_tokens``) above 1: a text answer of up to that
    many tokens, as an OpenAI-compatible server would give. 1 or absent: the yes/no answer
    (what yes/no clients ask with ``max_tokens: 1``), with ``--max-new-tokens`` applying."""
    body = rec["body"]
    n = body.get("max_completion_tokens", body.get("max_tokens"))
    if n is None:
        return None
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ManifestError(f"{where}: body.max_tokens must be a whole number >= 1, got {brief(n)}")
    return n if n > 1 else None
