"""Stage 1 and 2 of an embedding job whose items are OpenAI embedding requests
(``jobs/tasks.py``): a group's requests are prepared and embedded as one group of their
strings, and each request's results are its strings' embeddings, under the token limits of
``/v1/embeddings``. The file format itself, in and out, is ``openai_embeddings.py`` (a light
module: no torch, no decoding); its names are re-exported here for the task.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Generator, Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmbatch.jobs.openai_embeddings import (  # noqa: F401  (the last three: re-exported)
    MAX_INPUT_TOKENS,
    MAX_REQUEST_TOKENS,
    EmbedRequestItem,
    is_request_json,
    iter_embed_requests,
    to_embed_output,
)
from vlmbatch.pipeline.drive import PreparedGroup
from vlmbatch.pipeline.embed_drive import (
    PreparedEmbedGroup,
    prepare_embed_group,
    prepared_embed_groups,
)
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.pipeline.records import Embedding, EmbedItem, ErrorKind, ItemError
from vlmbatch.preprocessing.prepare import ImagePlan


@dataclass
class PreparedRequests:
    """Stage 1 of a group of requests: their inputs, in order, as one embedding group."""
    group: list[EmbedRequestItem]
    inputs: PreparedEmbedGroup


def _flat(group: list[Any]) -> list[EmbedItem]:
    """A group's inputs: a request's strings, in order, keyed by their place in the group."""
    if not group or not isinstance(group[0], EmbedRequestItem):
        return group
    texts = [t for r in group for t in r.texts]
    return [EmbedItem(k, None, None, t, Path("/")) for k, t in enumerate(texts)]


def prepare_items(group: list[Any], plan: ImagePlan,
                  max_pixels: int) -> PreparedEmbedGroup | PreparedRequests:
    """Stage 1 of a group of ``EmbedItem``s or of ``EmbedRequestItem``s."""
    peg = prepare_embed_group(_flat(group), plan, max_pixels)
    return _wrapped(group, peg)


def _wrapped(group: list[Any], peg: PreparedEmbedGroup) -> PreparedEmbedGroup | PreparedRequests:
    return PreparedRequests(group, peg) if group and isinstance(group[0], EmbedRequestItem) \
        else peg


def prepared_items(groups: Iterable[list[Any]], plan: ImagePlan, max_pixels: int,
                   threads: int, decode_timeout: float = 0.0, hooks: FaultHooks = NO_HOOKS
                   ) -> Generator[PreparedEmbedGroup | PreparedRequests, None, None]:
    """``prepared_embed_groups`` of groups of either kind of item, in order."""
    pulled: deque[list[Any]] = deque()

    def flat() -> Iterator[list[EmbedItem]]:
        for g in groups:
            pulled.append(g)
            yield _flat(g)

    with closing(prepared_embed_groups(flat(), plan, max_pixels, threads, decode_timeout,
                                       hooks)) as prepared:
        for peg in prepared:
            yield _wrapped(pulled.popleft(), peg)


def failed_request(item: EmbedRequestItem, err: ItemError) -> PreparedRequests:
    """A request whose stage 1 was lost (a Ray prepare task that died): texts need no
    preparing, so its inputs are embedded all the same."""
    return PreparedRequests([item], PreparedEmbedGroup(_flat([item]), PreparedGroup([], [], {})))


def request_results(pr: PreparedRequests, embedded: list[Embedding]) -> list[Embedding]:
    """Stage 2's embeddings of a group's inputs as its requests' results: ``id`` the
    request's ``custom_id``, ``index`` the string's place in its ``input``; a request over
    the token limits fails (``limited``)."""
    it = iter(embedded)
    return [e for r in pr.group for e in limited(
        [dataclasses.replace(next(it), index=i, id=r.custom_id) for i in range(len(r.texts))])]


def limited(results: list[Embedding]) -> list[Embedding]:
    """One request's results, the first input over ``MAX_INPUT_TOKENS`` (else the one that
    takes the request over ``MAX_REQUEST_TOKENS``) failed (``too_large``): the limits
    ``/v1/embeddings`` refuses a request over."""
    total = 0
    for k, e in enumerate(results):
        tokens = e.tokens or 0
        total += tokens
        if tokens > MAX_INPUT_TOKENS:
            why = f"{tokens:,} tokens, over the limit of {MAX_INPUT_TOKENS:,} per input"
        elif total > MAX_REQUEST_TOKENS:
            why = f"the request's inputs reach {total:,} tokens here, over the limit of " \
                  f"{MAX_REQUEST_TOKENS:,} per request"
        else:
            continue
        failed = Embedding(e.index, e.id, e.tokens, None, why, ErrorKind.TOO_LARGE)
        return [*results[:k], failed, *results[k + 1:]]
    return results
