"""Our torch engine: encode each image once, prefill many (image, question) prompts in batches
over an image-aware prefix KV cache, read P(yes) at the first generated position.

Flow of one ``score`` call::

    Request[] --build--> Prompt[]       chat template, image span expanded
    phases: with the cache, the first question of every image runs first (it computes and
            caches the image's prefix), then all the others (they hit it); without, one phase
    per phase:
      plan      longest cached prefix per prompt (full blocks, then the partial block that
                ends the shared prefix at </img>) -> past KV + past_len
      encode    images whose tokens are not all cached -> ImageEmbeds (vision batches of
                <= max_batch_tiles), once per image per call
      batches   sorted by new length, B * (P_max + T_max) <= max_batch_tokens
      prefill   text embeddings, image embeddings written into the uncached part of the span,
                Qwen2LM.prefill(past) -> logits [B, V] -> (p_yes, margin); new blocks cached

Counters (``EngineStats``) make the savings visible and testable: tiles encoded, tokens
prefilled, image tokens prefilled.

On CUDA the host must not wait for the GPU between batches, or the two take turns instead of
overlapping: host-to-device copies are non-blocking (``_to_device``), answer token indices
live on the device (``scoring``), and a call's P(yes) and margins are read back once, after
its last batch is queued. What still waits: that read-back, each decode step of a text
answer (it needs the chosen token), and the graph pool's guard after each vision call unless
the runner is stream-ordered (``build_engine`` builds it so).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.config import ConfigError, EngineConfig
from pipeline.llm import KV
from pipeline.model import LoadedModel
from pipeline.prefix_cache import BlockId, BlockKey, ImageSpan, PrefixCache, block_ids
from pipeline.prompt import Prompt, PromptBuilder
from pipeline.scoring import AnswerTokens, yes_no
from preprocessing.prepare import PreparedImage
from vit_trt.runners import TorchRunner, VitRunner


@dataclass(frozen=True)
class ImageEmbeds:
    cache_key: str
    embeds: torch.Tensor  # [num_tiles * tokens_per_tile, D_text]


@dataclass(frozen=True)
class Request:
    image: int  # index into the images passed to ``score``
    question: str
    max_new_tokens: int | None = None  # answer tokens to generate; None: the engine's


@dataclass(frozen=True)
class Score:
    p_yes: float
    margin: float  # logsumexp(yes logits) - logsumexp(no logits)
    image_tokens: int
    text: str | None = None  # greedy answer text when max_new_tokens > 0


@dataclass
class EngineStats:
    vision_tiles: int = 0  # tiles through the vision encoder
    prefill_tokens: int = 0  # real tokens computed by the LLM
    image_tokens_prefilled: int = 0  # of those, image tokens
    prompt_tokens: int = 0  # real tokens of all prompts (what a cacheless engine computes)


@dataclass
class _Plan:
    req: int  # index into requests
    prompt: Prompt
    span: ImageSpan
    # cache pool slots of the cached part of the prefix, in order; pinned until _release
    slots: list[int] = field(default_factory=list)
    past_len: int = 0
    blocks: list[tuple[int, BlockId]] = field(default_factory=list)  # (start, block) to cache
    chain: list[BlockKey] = field(default_factory=list)  # keys of the whole shared prefix

    @property
    def new_len(self) -> int:
        return len(self.prompt.ids) - self.past_len


# per queued batch: its plans, [B, 2] (p_yes, margin) on the device, its texts
_Queued = list[tuple[list[_Plan], torch.Tensor, list[str | None]]]


class TorchEngine:
    def __init__(self, model: LoadedModel, cfg: EngineConfig,
                 vision: VitRunner | None = None) -> None:
        self.model = model
        self.cfg = cfg
        self.device = next(model.llm.parameters()).device
        self.vision = vision or TorchRunner(model)
        self.prompts = PromptBuilder(model.tokenizer, model.spec.tokens_per_tile,
                                     model.spec.image_token_id)
        self.answers = AnswerTokens.from_words(model.tokenizer, cfg.yes_words, cfg.no_words)
        self.cache = PrefixCache(cfg.block_size, cfg.cache_bytes) if cfg.prefix_cache else None
        tok = model.tokenizer
        self.stop_ids = {i for i in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"),
                                     tok.convert_tokens_to_ids("<|endoftext|>"))
                         if i is not None and i != tok.unk_token_id}
        self.stats = EngineStats()
        if self.cache is not None:
            self._allocate_cache()

    def _allocate_cache(self) -> None:
        """The prefix cache's KV pool, now: a --cache-mib that cannot be had fails here,
        with what to do, rather than in every batch."""
        assert self.cache is not None
        s = self.model.spec.text
        try:
            self.cache.allocate((s.layers, 2, s.kv_heads, s.head_dim),
                                self.model.llm.embed_tokens.weight.dtype, self.device)
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"--cache-mib {self.cfg.cache_bytes >> 20}: the prefix cache's "
                              f"KV pool does not fit on {self.device} ({why}); give a smaller "
                              "--cache-mib, or --no-prefix-cache") from None

    def _to_device(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """A host list as a tensor on the engine's device, without waiting for the GPU:
        ``torch.tensor(..., device=cuda)`` copies synchronously, and a non-blocking copy from
        pageable memory may still wait when the driver stages a large one. So on CUDA the
        values go through pinned memory (torch's host allocator keeps the block until the
        copy is done)."""
        t = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def encode(self, images: list[PreparedImage]) -> list[ImageEmbeds]:
        """Run the vision encoder over all tiles, at most ``max_batch_tiles`` per forward."""
        if not images:
            return []
        tiles = np.concatenate([im.tiles for im in images])  # [N, S, S, 3]
        outs = []
        for start in range(0, len(tiles), self.cfg.max_batch_tiles):
            chunk = torch.from_numpy(tiles[start: start + self.cfg.max_batch_tiles])
            outs.append(self.vision.encode(chunk).to(self.device))  # [n, T, D]
        self.stats.vision_tiles += len(tiles)
        feats = torch.cat(outs)
        result, first = [], 0
        for im in images:
            n = im.grid.num_tiles
            result.append(ImageEmbeds(im.cache_key, feats[first: first + n].flatten(0, 1)))
            first += n
        return result

    @torch.inference_mode()
    def score(self, images: list[PreparedImage], requests: list[Request]) -> list[Score]:
        prompts = [self.prompts.build(r.question, images[r.image].grid.num_tiles)
                   for r in requests]
        self.stats.prompt_tokens += sum(len(p.ids) for p in prompts)  # what was asked
        embeds: dict[int, ImageEmbeds] = {}
        prefixes: dict[str, list[BlockId]] = {}
        done: _Queued = []
        for phase in self._phases(requests, prompts):
            plans: list[_Plan] = []
            try:
                for i in phase:  # each lookup pins: appended at once, so released below
                    plans.append(self._plan(i, prompts[i], images[requests[i].image], prefixes))
                done += self._run_phase(plans, requests, images, embeds)
            finally:
                self._release(plans)  # what an exception left pinned
        results: list[Score | None] = [None] * len(requests)
        if not done:
            return results  # type: ignore[return-value]
        host = torch.cat([s for _, s, _ in done]).tolist()  # [rows][2]: the call's one wait
        row = 0
        for batch, _, texts in done:
            for j, p in enumerate(batch):
                p_yes, margin = host[row]
                results[p.req] = Score(p_yes, margin, p.prompt.image_len, texts[j])
                row += 1
        return results  # type: ignore[return-value]

    def _run_phase(self, plans: list[_Plan], requests: list[Request],
                   images: list[PreparedImage], embeds: dict[int, ImageEmbeds]
                   ) -> _Queued:
        """Encode what the plans need and queue their prefills in batches: per batch, its
        plans, ``[B, 2]`` (p_yes, margin) on the device and its texts."""
        need = sorted({requests[p.req].image for p in plans
                       if p.past_len < p.span.start + p.span.length} - embeds.keys())
        embeds.update(zip(need, self.encode([images[i] for i in need])))
        plans.sort(key=lambda p: p.new_len, reverse=True)
        done: _Queued = []
        for batch in self._batches(plans):
            limits = [self._limit(requests[p.req]) for p in batch]
            scores, texts = self._prefill(
                batch, [embeds.get(requests[p.req].image) for p in batch], limits)
            # their cached KV was gathered into the batch's past: a later insert into the
            # same slots is queued after that gather on the same stream
            self._release(batch)
            done.append((batch, scores, texts))
        return done

    def _limit(self, r: Request) -> int:
        """Answer tokens to generate for ``r``: its own limit, else the engine's."""
        return self.cfg.max_new_tokens if r.max_new_tokens is None else r.max_new_tokens

    def _release(self, plans: list[_Plan]) -> None:
        """Unpin the cached blocks these plans looked up (once: ``past`` is emptied)."""
        if self.cache is None:
            return
        for p in plans:
            if p.slots:
                self.cache.unpin(p.chain[: len(p.slots)])
                p.slots = []

    def _phases(self, requests: list[Request], prompts: list[Prompt]) -> list[list[int]]:
        """Leaders (first question of each image) before followers, in chunks of images whose
        prefixes fit in half the cache budget, so a leader's blocks are still cached when its
        followers look for them."""
        if self.cache is None:
            return [list(range(len(requests)))]
        by_image: dict[int, list[int]] = {}
        for i, r in enumerate(requests):
            by_image.setdefault(r.image, []).append(i)
        chunks: list[list[int]] = [[]]
        used = 0
        bs = self.cache.block_size
        for image, reqs in by_image.items():  # a slot per block, the partial one included
            need = -(-prompts[reqs[0]].prefix_len // bs) * self.cache.slot_bytes
            if chunks[-1] and used + need > self.cache.budget_bytes // 2:
                chunks.append([])
                used = 0
            chunks[-1].append(image)
            used += need
        phases = []
        for chunk in chunks:
            phases.append([by_image[im][0] for im in chunk])
            phases.append([i for im in chunk for i in by_image[im][1:]])
        return [p for p in phases if p]

    def _plan(self, req: int, prompt: Prompt, image: PreparedImage,
              prefixes: dict[str, list[BlockId]]) -> _Plan:
        """Find the cached part of the prompt's shared prefix (up to and with </img>).

        Only the shared prefix is cached: the blocks after it hold the question, which the
        next request about the same image does not share. The prefix's last block may be
        partial, so a hit covers every image token, not only the full blocks.
        """
        span = ImageSpan(prompt.image_start, prompt.image_len, image.cache_key)
        plan = _Plan(req, prompt, span)
        if self.cache is None:
            return plan
        blocks = prefixes.get(image.cache_key)
        if blocks is None:  # same for every question about this image
            blocks = block_ids(prompt.ids, [span], self.cache.block_size,
                               limit=prompt.prefix_len, tail=True)
            prefixes[image.cache_key] = blocks
        plan.chain = [b.key for b in blocks]
        plan.slots = self.cache.lookup_slots(blocks)
        plan.past_len = sum(len(b.ids) for b in blocks[: len(plan.slots)])
        plan.blocks = [(k * self.cache.block_size, b)
                       for k, b in enumerate(blocks) if k >= len(plan.slots)]
        return plan

    def _batches(self, plans: list[_Plan]) -> list[list[_Plan]]:
        """Cut plans (sorted by new length, descending) so B * (P + T) <= max_batch_tokens."""
        batches: list[list[_Plan]] = []
        cur: list[_Plan] = []
        for p in plans:
            width = max([q.past_len for q in cur] + [p.past_len]) + (cur[0] if cur else p).new_len
            if cur and (len(cur) + 1) * width > self.cfg.max_batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(p)
        if cur:
            batches.append(cur)
        return batches

    def _prefill(self, batch: list[_Plan], images: list[ImageEmbeds | None], limits: list[int]
                 ) -> tuple[torch.Tensor, list[str | None]]:
        """One forward over ``batch``: ([B, 2] (p_yes, margin) on the device, texts)."""
        t = max(p.new_len for p in batch)
        ids = self._to_device([list(p.prompt.ids[p.past_len:]) + [0] * (t - p.new_len)
                               for p in batch])  # [B, T], right-padded
        lengths = self._to_device([p.new_len for p in batch])
        x = self.model.llm.embed_tokens(ids)  # [B, T, D]
        for j, (p, im) in enumerate(zip(batch, images)):
            lo = max(p.span.start, p.past_len)
            hi = p.span.start + p.span.length
            if hi > lo:
                assert im is not None
                x[j, lo - p.past_len: hi - p.past_len] = im.embeds[lo - p.span.start:].to(x.dtype)
                self.stats.image_tokens_prefilled += hi - lo
        self.stats.prefill_tokens += sum(p.new_len for p in batch)
        past, past_lengths = self._gather_past(batch)
        logits, new_kv = self.model.llm.prefill(x, lengths, past, past_lengths)  # [B, V]
        if self.cache is not None:
            self._insert(batch, new_kv)
        p_yes, margin = yes_no(logits, self.answers)
        texts = self._texts(limits, logits, past, past_lengths, new_kv, lengths)
        return torch.stack([p_yes, margin], 1), texts

    def _texts(self, limits: list[int], logits: torch.Tensor, past: list[KV] | None,
               past_lengths: torch.Tensor | None, new_kv: list[KV], lengths: torch.Tensor
               ) -> list[str | None]:
        """Greedy text for the rows whose limit is > 0 (None for the others): ``_generate``
        on those rows of the prefill's logits and KV only."""
        rows = [j for j, n in enumerate(limits) if n > 0]
        if not rows:
            return [None] * len(limits)
        if len(rows) < len(limits):  # a subset: its rows of everything (a copy)
            sel = self._to_device(rows)
            logits, lengths = logits[sel], lengths[sel]
            past = None if past is None else [(k[sel], v[sel]) for k, v in past]
            past_lengths = None if past_lengths is None else past_lengths[sel]
            new_kv = [(k[sel], v[sel]) for k, v in new_kv]
        generated = self._generate(logits, past, past_lengths, new_kv, lengths,
                                   [limits[j] for j in rows])
        texts: list[str | None] = [None] * len(limits)
        for j, text in zip(rows, generated):
            texts[j] = text
        return texts

    def _generate(self, logits: torch.Tensor, past: list[KV] | None,
                  past_lengths: torch.Tensor | None, new_kv: list[KV],
                  lengths: torch.Tensor, limits: list[int]) -> list[str | None]:
        """Greedy decode after a prefill, batched; row j stops at an end token or after
        ``limits[j]`` tokens (all >= 1).

        Keys are [past (padded to P) | new (padded to T) | generated]; ``valid`` masks the
        padding holes. Positions continue each row's own length.
        """
        b = logits.shape[0]
        kv = new_kv if past is None else [
            (torch.cat([pk, nk], 2), torch.cat([pv, nv], 2))
            for (pk, pv), (nk, nv) in zip(past, new_kv)]
        width = new_kv[0][0].shape[2]  # T of the whole batch: rows may be a subset of it
        valid = torch.arange(width, device=self.device)[None] < lengths[:, None]
        pos = lengths.clone()
        if past is not None and past_lengths is not None:
            p = past[0][0].shape[2]
            seen = torch.arange(p, device=self.device)[None] < past_lengths[:, None]
            valid = torch.cat([seen, valid], 1)
            pos += past_lengths
        out: list[list[int]] = [[] for _ in range(b)]
        done = [False] * b
        tok = logits.argmax(-1)
        for _ in range(max(limits)):
            for j, t in enumerate(tok.tolist()):  # one device-to-host copy per step
                if not done[j]:
                    done[j] = t in self.stop_ids and not self.cfg.ignore_eos
                    if not done[j]:
                        out[j].append(t)
                        done[j] = len(out[j]) >= limits[j]
            if all(done):
                break
            x = self.model.llm.embed_tokens(tok)[:, None]  # [B, 1, D]
            step_logits, step_kv = self.model.llm.decode_step(x, pos, kv, valid)
            kv = [(torch.cat([k, sk], 2), torch.cat([v, sv], 2))
                  for (k, v), (sk, sv) in zip(kv, step_kv)]
            valid = torch.cat([valid, torch.ones((b, 1), dtype=torch.bool,
                                                 device=self.device)], 1)
            pos += 1
            tok = step_logits.argmax(-1)
        dec = self.model.tokenizer.decode
        return [dec(ids, skip_special_tokens=True) for ids in out]

    def _gather_past(self, batch: list[_Plan]) -> tuple[list[KV] | None, torch.Tensor | None]:
        """Cached prefixes -> per layer (k, v) ``[B, K, P, d]``, P the longest prefix; one
        gather from the pool for the whole batch. Row j's keys past its own ``past_len``
        (another slot's or a padding slot's, all finite) are masked by ``past_lengths``."""
        longest = max(p.past_len for p in batch)
        if longest == 0:
            return None, None
        assert self.cache is not None
        nb = max(len(p.slots) for p in batch)
        fill = next(p.slots[0] for p in batch if p.slots)  # a slot in use: finite
        idx = self._to_device([p.slots + [fill] * (nb - len(p.slots)) for p in batch])
        pool = self.cache.pool  # [S, L, 2, K, bs, d]
        _, layers, _, kv_heads, bs, d = pool.shape
        g = pool[idx]  # [B, nb, L, 2, K, bs, d]
        g = g.permute(2, 3, 0, 4, 1, 5, 6).reshape(layers, 2, len(batch), kv_heads, nb * bs, d)
        g = g[..., :longest, :]
        past = [(g[i, 0], g[i, 1]) for i in range(layers)]
        return past, self._to_device([p.past_len for p in batch])

    def _insert(self, batch: list[_Plan], new_kv: list[KV]) -> None:
        assert self.cache is not None
        k_all = torch.stack([k for k, _ in new_kv], 1)  # [B, L, K, T, d]
        v_all = torch.stack([v for _, v in new_kv], 1)
        for j, p in enumerate(batch):
            pinned: list[BlockKey] = []
            try:  # pinned while the chain goes in: a pool too small for it keeps its head
                for start, blk in p.blocks:
                    lo = start - p.past_len
                    hi = lo + len(blk.ids)
                    kv = torch.stack([k_all[j, :, :, lo:hi], v_all[j, :, :, lo:hi]], 1)
                    if self.cache.insert(blk, kv, pin=True):  # [L, 2, K, n, d], copied
                        pinned.append(blk.key)
            finally:  # also after an error (e.g. out of memory): the runner goes on
                self.cache.unpin(pinned)
            self.cache.touch(p.chain)
