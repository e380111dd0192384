"""Our torch engine: encode images once, prefill many (image, question) prompts in batches,
read P(yes) at the first generated position.

Flow of one ``score`` call::

    PreparedImage[]  --encode-->  ImageEmbeds[]      (vision batches of <= max_batch_tiles)
    Request[]        --build-->   Prompt[]           (chat template, image span expanded)
    sort by length, cut into batches with B * T_max <= max_batch_tokens
    per batch: text embeddings, image embeddings written into each span,
               Qwen2LM.prefill_last -> logits [B, V] -> (p_yes, margin)

An image asked K questions is encoded once; its image tokens are still prefilled K times
(the image-aware prefix cache of issue 5 removes that).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.config import EngineConfig
from pipeline.model import LoadedModel
from pipeline.prompt import Prompt, PromptBuilder
from pipeline.scoring import AnswerTokens, yes_no
from preprocessing.prepare import PreparedImage


@dataclass(frozen=True)
class ImageEmbeds:
    content_hash: str
    embeds: torch.Tensor  # [num_tiles * tokens_per_tile, D_text]


@dataclass(frozen=True)
class Request:
    image: int  # index into the images passed to ``score``
    question: str


@dataclass(frozen=True)
class Score:
    p_yes: float
    margin: float  # logsumexp(yes logits) - logsumexp(no logits)
    image_tokens: int


class TorchEngine:
    def __init__(self, model: LoadedModel, cfg: EngineConfig) -> None:
        self.model = model
        self.cfg = cfg
        self.device = next(model.llm.parameters()).device
        self.prompts = PromptBuilder(model.tokenizer, model.spec.tokens_per_tile,
                                     model.spec.image_token_id)
        self.answers = AnswerTokens.from_words(model.tokenizer, cfg.yes_words, cfg.no_words)
        self.vision_tiles = 0  # tiles encoded so far (tests count them)

    @torch.inference_mode()
    def encode(self, images: list[PreparedImage]) -> list[ImageEmbeds]:
        """Run the vision encoder over all tiles, at most ``max_batch_tiles`` per forward."""
        if not images:
            return []
        tiles = np.concatenate([im.tiles for im in images])  # [N, S, S, 3]
        outs = []
        for start in range(0, len(tiles), self.cfg.max_batch_tiles):
            chunk = torch.from_numpy(tiles[start: start + self.cfg.max_batch_tiles])
            outs.append(self.model.vision(chunk.to(self.device)))  # [n, T, D]
        self.vision_tiles += len(tiles)
        feats = torch.cat(outs)
        result, first = [], 0
        for im in images:
            n = im.grid.num_tiles
            result.append(ImageEmbeds(im.content_hash, feats[first: first + n].flatten(0, 1)))
            first += n
        return result

    @torch.inference_mode()
    def score(self, images: list[PreparedImage], requests: list[Request]) -> list[Score]:
        embeds = self.encode(images)
        prompts = [self.prompts.build(r.question, images[r.image].grid.num_tiles)
                   for r in requests]
        order = sorted(range(len(requests)), key=lambda i: len(prompts[i].ids), reverse=True)
        results: list[Score | None] = [None] * len(requests)
        for batch in self._batches(order, prompts):
            p_yes, margin = self._prefill([prompts[i] for i in batch],
                                          [embeds[requests[i].image] for i in batch])
            for j, i in enumerate(batch):
                results[i] = Score(float(p_yes[j]), float(margin[j]), prompts[i].image_len)
        return results  # type: ignore[return-value]

    def _batches(self, order: list[int], prompts: list[Prompt]) -> list[list[int]]:
        """Cut length-sorted (descending) requests so that B * T_max <= max_batch_tokens."""
        batches: list[list[int]] = []
        cur: list[int] = []
        for i in order:
            longest = len(prompts[cur[0]].ids) if cur else len(prompts[i].ids)
            if cur and (len(cur) + 1) * longest > self.cfg.max_batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
        return batches

    def _prefill(self, prompts: list[Prompt],
                 images: list[ImageEmbeds]) -> tuple[torch.Tensor, torch.Tensor]:
        b, t = len(prompts), max(len(p.ids) for p in prompts)
        ids = torch.zeros((b, t), dtype=torch.long)
        lengths = torch.empty(b, dtype=torch.long)
        for j, p in enumerate(prompts):
            ids[j, : len(p.ids)] = torch.tensor(p.ids)
            lengths[j] = len(p.ids)
        x = self.model.llm.embed_tokens(ids.to(self.device))  # [B, T, D]
        for j, (p, im) in enumerate(zip(prompts, images)):
            x[j, p.image_start: p.image_start + p.image_len] = im.embeds.to(x.dtype)
        logits = self.model.llm.prefill_last(x, lengths.to(self.device))  # [B, V]
        p_yes, margin = yes_no(logits, self.answers)
        return p_yes.cpu(), margin.cpu()
