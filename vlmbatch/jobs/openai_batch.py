"""The OpenAI Batch API file format, in and out.

Input line (one chat completion request)::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [{"role": "user", "content": [
         {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
         {"type": "text", "text": "Is there a red shape?"}]}]}}

Each request becomes one item with one question (its text parts joined) about its one image
(the only ``image_url`` part). ``file://`` and ``data:`` URLs and local paths are read;
http(s) (and s3/gs/az) URLs are fetched by the fetch stage, a failure that item's ``source``
error (``docs/data_sources.md``; the server refuses them unless ``--allow-remote-media``).
Requests for the same image share its prefix cache entry, keyed by pixel content. A body
with vLLM's ``structured_outputs: {"choice": [...]}`` (or ``guided_choice: [...]``, its older
name) asks a label-set question: the answer is the most probable choice
(``Question.choices``).

Output line: ``{"id", "custom_id", "response": {"status_code": 200, "request_id", "body":
<chat.completion>}, "error": null}``; a failed item gets ``"response": null`` and
``"error": {"code", "message"}``, the code naming its ``ErrorKind`` (``decode_error``,
``source_error``, ``too_large_error``, ``engine_error``, ...). The completion's content is
``"yes"``/``"no"`` (a label set's most probable choice), or the generated text when the
request's ``max_completion_tokens``/``max_tokens`` is above 1 (up to that many tokens) or
``--max-new-tokens`` is set; ``p_yes`` and ``margin`` (a label set's ``label``, ``probs`` and
``logprobs``) ride along in the body under ``"vlmbatch"``.
"""

from __future__ import annotations

import json
from pathlib import Path

from vlmbatch.jobs.errors import ManifestError, brief, check_id, parse_choices
from vlmbatch.pipeline.records import Answer, ImageItem, Question


def is_openai_request(rec: dict) -> bool:
    return "custom_id" in rec and "body" in rec


def parse_request(rec: dict, where: str, base_dir: Path) -> ImageItem:
    if rec.get("url", "/v1/chat/completions") != "/v1/chat/completions":
        also = ("; embedding requests go in a file of their own (a batch with endpoint "
                "/v1/embeddings, or `submit --task embed`)" if rec.get("url") ==
                "/v1/embeddings" else "")
        raise ManifestError(f"{where}: url {brief(rec.get('url'))} is not supported; "
                            f"only /v1/chat/completions{also}")
    messages = rec["body"].get("messages") if isinstance(rec["body"], dict) else None
    if not isinstance(messages, list) or not messages:
        raise ManifestError(f"{where}: body.messages must be a non-empty list")
    texts, images = [], []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ManifestError(f"{where}: body.messages[{i}] must be an object, got {brief(msg)}")
        content = msg.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if msg.get("role") != "user" or not isinstance(parts, list):
            continue  # system/assistant turns carry no image or question here
        for part in parts:
            if not isinstance(part, dict):
                raise ManifestError(f"{where}: body.messages[{i}] has a content part that is "
                                    f"not an object: {brief(part)}")
            if part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif part.get("type") == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or not url:
                    raise ManifestError(f"{where}: image_url part without a url")
                images.append(url)
    if len(images) != 1:
        raise ManifestError(f"{where}: each request needs exactly one image_url part, "
                            f"found {len(images)}")
    question = " ".join(t.strip() for t in texts if t.strip())
    if not question:
        raise ManifestError(f"{where}: no text part to ask")
    return ImageItem(check_id(rec["custom_id"], where, "custom_id"), images[0],
                     (Question("q0", question, max_new_tokens=_answer_tokens(rec, where),
                               choices=_choices(rec["body"], where)),), base_dir)


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


def usage(prompt: int | None, completion: int | None) -> dict:
    """OpenAI's ``usage``; ``total_tokens`` only when both counts are known (answers
    recorded by versions that kept no counts have none: null)."""
    total = prompt + completion if prompt is not None and completion is not None else None
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total}


def to_output(a: Answer) -> dict:
    """One answer -> one OpenAI batch output line."""
    rid = f"vlmbatch-{a.image_id}"
    if a.error:
        kind = a.error_kind.value if a.error_kind is not None else "unknown"
        return {"id": rid, "custom_id": a.image_id, "response": None,
                "error": {"code": f"{kind}_error", "message": a.error}}
    content = a.text if a.text is not None else a.answer
    body = {"id": rid, "object": "chat.completion", "model": "vlmbatch",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": content}}],
            "usage": usage(a.prompt_tokens, a.completion_tokens),
            "vlmbatch": vlmbatch_fields(a)}
    return {"id": rid, "custom_id": a.image_id,
            "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}


def vlmbatch_fields(a: Answer) -> dict:
    """The completion body's ``vlmbatch`` field: ``p_yes``, ``margin`` and ``image_tokens``,
    and for a label-set question its ``label``, ``probs`` and ``logprobs`` (``Answer``)."""
    out: dict = {"p_yes": a.p_yes, "margin": a.margin, "image_tokens": a.image_tokens}
    if a.choices:
        out.update(label=a.label, probs=a.probs, logprobs=a.logprobs)
    return out


def write_lines(answers: list[Answer], openai: bool) -> str:
    """JSONL text of ``answers``: our result lines, or OpenAI batch output lines."""
    return "".join(json.dumps(to_output(a) if openai else a.line(), ensure_ascii=False) + "\n"
                   for a in answers)
