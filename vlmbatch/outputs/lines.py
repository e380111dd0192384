"""Result lines as the outputs write them: ours (``Answer.line``) and the OpenAI Batch API's
output lines, chat (``to_output``) and embeddings (``to_embed_output``); the input side of
those formats: ``inputs/openai_batch.py``, ``inputs/openai_embeddings.py``.

Chat: ``{"id", "custom_id", "response": {"status_code": 200, "request_id", "body":
<chat.completion>}, "error": null}``; a failed item gets ``"response": null`` and
``"error": {"code", "message"}``, the code naming its ``ErrorKind`` (``decode_error``,
``source_error``, ``too_large_error``, ``engine_error``, ...). The completion's content is
``"yes"``/``"no"`` (a label set's most probable choice), or the generated text when the
request's ``max_completion_tokens``/``max_tokens`` is above 1 (up to that many tokens) or
``--max-new-tokens`` is set; ``p_yes`` and ``margin`` (a label set's ``label``, ``probs`` and
``logprobs``) ride along in the body under ``"vlmbatch"``.

Embeddings: ``{"id", "custom_id", "response": {"status_code": 200, "request_id", "body":
{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
"usage": {"prompt_tokens", "total_tokens"}}}, "error": null}``; a request with an input
that failed gets ``"response": null`` and ``"error": {"code", "message"}`` (the code naming
the failure's ``ErrorKind``, as chat lines do: ``engine_error``, ...).
"""

from __future__ import annotations

import base64
import json

import numpy as np

from vlmbatch.inputs.openai_embeddings import EmbedRequestItem
from vlmbatch.pipeline.records import Answer, Embedding


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
    for a label-set question its ``label``, ``probs`` and ``logprobs``, and for a clip's
    item ``frames`` and ``seconds``, what the model saw (``Answer``)."""
    out: dict = {"p_yes": a.p_yes, "margin": a.margin, "image_tokens": a.image_tokens}
    if a.choices:
        out.update(label=a.label, probs=a.probs, logprobs=a.logprobs)
    if a.frames is not None:
        out.update(frames=a.frames, seconds=list(a.seconds or ()))
    return out


def write_lines(answers: list[Answer], openai: bool) -> str:
    """JSONL text of ``answers``: our result lines, or OpenAI batch output lines."""
    return "".join(json.dumps(to_output(a) if openai else a.line(), ensure_ascii=False) + "\n"
                   for a in answers)


def _vector(v: np.ndarray, dims: int | None) -> np.ndarray:
    """``v`` [D] at ``dims`` components: truncated and re-normalised (Matryoshka)."""
    v = np.asarray(v, dtype=np.float32)
    if dims is None or dims >= v.shape[-1]:
        return v
    cut = v[:dims]
    return (cut / np.linalg.norm(cut)).astype(np.float32)


def to_embed_output(item: EmbedRequestItem, results: list[Embedding], model: str) -> dict:
    """One request and its recorded results -> one OpenAI batch output line."""
    rid = f"vlmbatch-{item.custom_id}"
    bad = next((e for e in results if e.error is not None or e.vector is None), None)
    if bad is not None or len(results) != len(item.texts):
        kind = bad.error_kind.value if bad is not None and bad.error_kind else "unknown"
        why = bad.error if bad is not None else "results are missing"
        return {"id": rid, "custom_id": item.custom_id, "response": None,
                "error": {"code": f"{kind}_error",
                          "message": f"input {bad.index if bad else '?'}: {why}"}}
    data = []
    for e in sorted(results, key=lambda e: e.index):
        assert e.vector is not None
        v = _vector(e.vector, item.dimensions).astype("<f4")
        data.append({"object": "embedding", "index": e.index,
                     "embedding": (base64.b64encode(v.tobytes()).decode()
                                   if item.encoding_format == "base64" else v.tolist())})
    n = sum(e.tokens or 0 for e in results)
    body = {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": n, "total_tokens": n}}
    return {"id": rid, "custom_id": item.custom_id,
            "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}
