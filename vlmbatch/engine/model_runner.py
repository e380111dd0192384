"""The torch engine's tensor half (nano-vllm's ``ModelRunner``): the vision encoder over
the images a phase needs, one prefill forward per batch (text embeddings with image
embeddings written into the uncached part of each image span, the cached prefixes gathered
from the KV pool in one gather, new prefix blocks copied in), P(yes) and margin from the
first generated position, a label set's log-likelihoods for the rows that have one (the
first token's from the prefill; the others from one continuation forward of every choice
side by side after the prompt's KV: ``engine/choices.py``), and greedy decoding for the
rows that want text. What to run and in which batches is the planner's (``engine/planner.py``).

What differs between families reaches the runner only through ``models.base``'s records:
the prompt's M-RoPE ``positions`` (a row after a cached prefix of k tokens takes
``positions[:, k:]``) and ``rope_delta`` (decode positions), the vision module's kind (tiles
cut anywhere, or packed images cut between images, ``VitRunner.packed``) and its DeepStack
features, which are sliced exactly like the embeddings.

On CUDA the host must not wait for the GPU between batches, or the two take turns instead of
overlapping: host-to-device copies are non-blocking (``to_device``), answer token indices
live on the device (``scoring``), and results stay on the device until the engine reads a
call's back once. What still waits: each decode step of a text answer (it needs the chosen
token), and the graph pool's guard after each vision call unless the runner is
stream-ordered (``engine/torch_engine.py`` builds it so).

Shapes: B rows, T new tokens (padded), P cached prefix (padded), L layers, K kv heads, d
head dim, D hidden.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vlmbatch.engine import packing
from vlmbatch.engine.base import EngineStats
from vlmbatch.engine.choices import AfterPrefill, choice_logprobs
from vlmbatch.engine.features import FeatureCache, Features, span_embeddings
from vlmbatch.engine.packing import Row
from vlmbatch.engine.planner import Plan
from vlmbatch.engine.prefix_cache import BlockKey, PrefixCache
from vlmbatch.engine.records import Item, MediaItem
from vlmbatch.engine.scoring import AnswerTokens, ChoiceIds, yes_no
from vlmbatch.engine.state_snapshots import (
    StateCodec,
    join_layers,
    restore,
    snapshot,
    snapshot_at,
    split_layers,
    take_snapshots,
)
from vlmbatch.models.base import KV, DeepStack, LoadedModel, Prompt
from vlmbatch.preprocessing.prepare import PreparedImage
from vlmbatch.vit_trt.base import VitRunner

Generated = tuple[str, int]  # a row's greedy text and its token count

# a packed model's images go through the vision module in calls of at most
# max_batch_tiles * PATCHES_PER_TILE rows: one 448 px InternVL tile is 32 x 32 patches of 14 px
PATCHES_PER_TILE = 1024


@dataclass(frozen=True)
class StepInputs:
    """A step of rows' host inputs (``ModelRunner.step_inputs``): the arrays, their one
    int64 buffer (token ids, positions, segments, questions' last tokens, image token
    destinations), M-RoPE positions ``[3, B, T]`` or None, each row's longest prompt (dynamic
    rotary) or None."""
    arrays: packing.StepArrays
    host: torch.Tensor
    positions: torch.Tensor | None
    seq_lens: list[int] | None


@dataclass(frozen=True)
class ImageEmbeds:
    cache_key: str
    embeds: torch.Tensor  # [image tokens, D_text] (InternVL: num_tiles * tokens_per_tile)
    deepstack: tuple[torch.Tensor, ...] = ()  # Qwen3-VL: one [image tokens, D_text] per layer


class ModelRunner:
    def __init__(self, model: LoadedModel, vision: VitRunner, cache: PrefixCache | None,
                 answers: AnswerTokens, stats: EngineStats, max_batch_tiles: int,
                 ignore_eos: bool = False, compile_llm: bool = False) -> None:
        self.model = model
        # the decoder's prefill through torch.compile (inductor, dynamic shapes: one graph for
        # every batch, prompt and cached length; fewer, fused kernels where the host launches
        # ~30,000 per round at InternVL3-1B's shape): --compile-llm, equal to eager
        self.prefill_fn = (torch.compile(model.llm.prefill, dynamic=True) if compile_llm
                           else model.llm.prefill)
        self.vision = vision
        self.cache = cache
        self.answers = answers
        self.stats = stats
        self.max_batch_tiles = max_batch_tiles
        self.features = FeatureCache()  # clips' frame groups by content (``features.py``)
        self.ignore_eos = ignore_eos
        self.device = next(model.llm.parameters()).device
        self._dynamic = getattr(model.llm.spec, "rope_scaling", "none") == "dynamic"
        # a hybrid decoder (Qwen3.5): the pool holds the full layers' K/V only, the linear
        # layers' states go through snapshots (``state_snapshots.py``)
        self.kinds = model.llm.kinds
        self.full = [i for i, kind in enumerate(self.kinds) if kind == "full"]
        self.codec = (StateCodec(model.llm.state_shapes()) if len(self.full) < len(self.kinds)
                      else None)
        tok = model.tokenizer
        self.stop_ids = {i for i in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"),
                                     tok.convert_tokens_to_ids("<|endoftext|>"))
                         if i is not None and i != tok.unk_token_id}

    def to_device(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
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
    def encode(self, items: Sequence[Item]) -> list[ImageEmbeds]:
        """One ``ImageEmbeds`` per item, in order: still images through ``encode_images``
        (as before), a ``MediaItem`` through ``encode_item``."""
        if all(isinstance(it, PreparedImage) for it in items):
            return self.encode_images(items)  # type: ignore[arg-type]
        images = [it for it in items if isinstance(it, PreparedImage)]
        done = iter(self.encode_images(images))
        return [next(done) if isinstance(it, PreparedImage) else self.encode_item(it)
                for it in items]

    @torch.inference_mode()
    def encode_images(self, images: list[PreparedImage]) -> list[ImageEmbeds]:
        """Run the vision encoder over all images' rows; one ``ImageEmbeds`` per image, its
        tokens in order. Tiles go at most ``max_batch_tiles`` per forward, cut anywhere;
        packed images about ``max_batch_tiles * PATCHES_PER_TILE`` rows, cut between
        images."""
        if not images:
            return []
        if self.vision.packed:
            return self._encode_packed(images)
        tiles = np.concatenate([im.rows for im in images])  # [N, S, S, 3]
        outs = []
        for start in range(0, len(tiles), self.max_batch_tiles):
            chunk = torch.from_numpy(tiles[start: start + self.max_batch_tiles])
            outs.append(self.vision.encode(chunk).to(self.device))  # [n, T, D]
        self.stats.vision_tiles += len(tiles)
        feats = (torch.cat(outs) if len(outs) > 1 else outs[0]).flatten(0, 1)  # [N * T, D]
        per = feats.shape[0] // len(tiles)  # tokens per tile
        parts = feats.split([len(im.rows) * per for im in images])  # one op for all
        return [ImageEmbeds(im.cache_key, part) for im, part in zip(images, parts)]

    def encode_item(self, item: MediaItem) -> ImageEmbeds:
        """A ``MediaItem``'s embeddings over its whole span (``features.span_embeddings``)."""
        def encode(images: list[PreparedImage]) -> list[Features]:
            return [(e.embeds, e.deepstack) for e in self.encode_images(images)]

        embeds, deep = span_embeddings(item, self.model, encode, self.features, self.device)
        return ImageEmbeds(item.cache_key, embeds, deep)

    def _encode_packed(self, images: list[PreparedImage]) -> list[ImageEmbeds]:
        """Packed images in calls of whole images; each image's share of the call's tokens
        is its share of the rows (the module merges a fixed number of rows per token)."""
        budget = self.max_batch_tiles * PATCHES_PER_TILE
        result: list[ImageEmbeds] = []
        for chunk in _chunks([len(im.rows) for im in images], budget):
            ims = [images[i] for i in chunk]
            rows = torch.from_numpy(np.concatenate([im.rows for im in ims]))  # [N, row]
            out = self.vision.encode_packed(rows, [im.grid.dims for im in ims])
            n, m = len(rows), out.embeds.shape[0]
            if n % m:
                raise ValueError(f"the vision module gave {m} tokens for {n} rows")
            first = 0
            for im in ims:
                k = len(im.rows) // (n // m)
                cut = slice(first, first + k)
                result.append(ImageEmbeds(im.cache_key, out.embeds[cut].to(self.device),
                                          tuple(f[cut].to(self.device) for f in out.deepstack)))
                first += k
            self.stats.vision_tiles += n
        return result

    def prefill(self, batch: list[Plan], images: list[ImageEmbeds | None], limits: list[int],
                choices: list[ChoiceIds] | None = None, first_token: bool = False
                ) -> tuple[torch.Tensor, list[Generated | None], torch.Tensor | None]:
        """One forward over ``batch``: ([B, 2] (p_yes, margin) on the device, each row's
        generated (text, tokens) or None, the choices' log-likelihoods ``[M]`` on the device
        (``choices``: each row's label set, () for none; every choice of every row in order;
        None without any), only their first tokens' with ``first_token``)."""
        x, lengths, positions, deep = self._inputs(batch, images)
        past, past_lengths = self._gather_past(batch)
        logits, new_kv = self.prefill_fn(x, lengths, past, past_lengths, positions=positions,
                                         deepstack=deep, **self._state_at(batch))  # [B, V]
        new_kv = self._cache_new(batch, new_kv)
        p_yes, margin = yes_no(logits, self.answers)
        after = AfterPrefill(past, past_lengths, new_kv, lengths,
                             [p.prompt.rope_delta for p in batch],
                             batch[0].prompt.positions is not None)
        lp = choice_logprobs(self.model.llm, self.to_device, choices or [()] * len(batch),
                             logits, after, first_token)
        texts = self._texts(limits, logits, after)
        return torch.stack([p_yes, margin], 1), texts, lp

    def step_inputs(self, step: list[Row], prompts: list[Prompt]) -> StepInputs:
        """A step's host inputs (``packing.arrays``, M-RoPE positions, each row's longest
        prompt), as host tensors ready to copy (pinned on CUDA): no device work, so it may
        run on another thread while the previous step's forward runs (``TorchEngine``)."""
        arr = packing.arrays(step, prompts)
        host = torch.from_numpy(np.concatenate([arr.tokens.ravel(), arr.at, arr.image_index]))
        pos = None
        if step[0].plan.prompt.positions is not None:
            pos = _row_positions(step, prompts, arr.tokens.shape[2])
        if self.device.type == "cuda":
            host = host.pin_memory()
            pos = None if pos is None else pos.pin_memory()
        lens = [max([len(prompts[i].ids) for i in r.members]) for r in step] \
            if self._dynamic else None
        return StepInputs(arr, host, pos, lens)

    def prefill_rows(self, step: list[Row], images: list[ImageEmbeds | None],
                     inputs: StepInputs) -> torch.Tensor:
        """One forward over a step of rows (``engine/packing.py``: an image's uncached
        prefix and its questions in one row each; ``inputs``: ``step_inputs``): ``[Q, 2]``
        (p_yes, margin) on the device, the rows' questions in order; the prefixes' new
        blocks cached. ``images``: each row's image embeddings (None: none of its image is
        computed)."""
        arr = inputs.arrays
        b, t = arr.tokens.shape[1:]
        n, q = 3 * b * t, len(arr.at)  # one host-to-device copy for the step's indices
        host = inputs.host.to(self.device, non_blocking=True)
        ids, pos, seg = host[:n].view(3, b, t).unbind(0)
        at = host[n: n + q]
        x = self.model.llm.embed_tokens(ids)  # [B, T, D]
        plans = [r.plan for r in step]
        deep = self._place_images(x, arr.image_at, host[n + q:], images)
        positions = pos if inputs.positions is None else inputs.positions.to(
            self.device, non_blocking=True)
        past, past_lengths = self._gather_past(plans)
        seq_lens = None if inputs.seq_lens is None else self.to_device(inputs.seq_lens)
        logits, new_kv = self.model.llm.prefill_segments(
            x, positions, seg, at, past, past_lengths, deepstack=deep, seq_lens=seq_lens)
        self.stats.prefill_tokens += sum([r.new_len for r in step])
        if self.cache is not None:
            self._insert(plans, new_kv, None)  # rows: full attention only, no snapshot
        p_yes, margin = yes_no(logits, self.answers)
        return torch.stack([p_yes, margin], 1)

    def _place_images(self, x: torch.Tensor, image_at: list[tuple[int, int, int]],
                      index: torch.Tensor, images: list[ImageEmbeds | None]
                      ) -> DeepStack | None:
        """Write each row's uncached image tokens into ``x [B, T, D]`` (row j from column
        ``col`` on, the image's tokens from ``k``: ``packing.StepArrays.image_at``; their
        flat destinations ``index``) in one copy; their DeepStack features (Qwen3-VL)
        likewise, in row order (None without)."""
        if not image_at:
            return None
        b, t, d = x.shape
        srcs: list[torch.Tensor] = []
        deep: list[list[torch.Tensor]] = []
        for j, _, k in image_at:
            im = images[j]
            assert im is not None
            srcs.append(im.embeds if k == 0 else im.embeds[k:])
            if im.deepstack:
                deep.append([f if k == 0 else f[k:] for f in im.deepstack])
        self.stats.image_tokens_prefilled += index.shape[0]
        src = torch.cat(srcs) if len(srcs) > 1 else srcs[0]
        x.view(b * t, d).index_copy_(0, index, src if src.dtype == x.dtype else src.to(x.dtype))
        if not deep:
            return None
        mask = torch.zeros(b * t, dtype=torch.bool, device=x.device)
        mask[index] = True
        return DeepStack(mask.view(b, t), tuple(torch.cat(fs).to(x.dtype)
                                                for fs in zip(*deep)))

    def hidden(self, batch: list[Plan], images: list[ImageEmbeds | None]) -> torch.Tensor:
        """One forward over ``batch`` for embeddings: the last hidden states ``[B, T, D]`` of
        the new tokens (row j's first ``new_len`` real; new position t is prompt position
        ``past_len + t``), the new prefix blocks cached as ``prefill`` caches them."""
        x, lengths, positions, deep = self._inputs(batch, images)
        past, past_lengths = self._gather_past(batch)
        hidden, new_kv = self.model.llm.prefill_hidden(x, lengths, past, past_lengths,
                                                       positions=positions, deepstack=deep,
                                                       **self._state_at(batch))
        self._cache_new(batch, new_kv)
        return hidden

    def _state_at(self, batch: list[Plan]) -> dict[str, torch.Tensor]:
        """The decoder's ``state_at`` keyword when a row takes a state snapshot (a hybrid
        decoder's prefix found nowhere: ``state_snapshots.snapshot_at``), else none."""
        at = snapshot_at(batch) if self.codec is not None and self.cache is not None else None
        return {} if at is None else {"state_at": self.to_device(at)}

    def _cache_new(self, batch: list[Plan], new_kv: list[KV]) -> list[KV]:
        """Cache a forward's new prefix blocks and state snapshots (``_insert``); its
        per-layer output without the snapshot rows (``take_snapshots``)."""
        snaps = None
        if self.codec is not None and any(p.snapshots for p in batch):
            new_kv, snaps = take_snapshots(self.kinds, new_kv, len(batch))
        if self.cache is not None:
            self._insert(batch, new_kv, snaps)
        return new_kv

    def _inputs(self, batch: list[Plan], images: list[ImageEmbeds | None]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, DeepStack | None]:
        """The new tokens' input embeddings ``[B, T, D]`` (right-padded; image embeddings in
        the uncached part of each image span), their lengths ``[B]``, their M-RoPE positions
        (or None) and DeepStack features (or None); counted in stats."""
        t = max(p.new_len for p in batch)
        ids = self.to_device([list(p.prompt.ids[p.past_len:]) + [0] * (t - p.new_len)
                               for p in batch])  # [B, T], right-padded
        lengths = self.to_device([p.new_len for p in batch])
        x = self.model.llm.embed_tokens(ids)  # [B, T, D]
        deep = self._image_spans(batch, images, x)
        self.stats.prefill_tokens += sum(p.new_len for p in batch)
        return x, lengths, self._positions(batch, t), deep

    def _image_spans(self, batch: list[Plan], images: list[ImageEmbeds | None],
                     x: torch.Tensor) -> DeepStack | None:
        """Write each row's uncached image tokens into ``x [B, T, D]`` (in place); their
        DeepStack features, sliced the same way, in row order (None without any)."""
        mask = None
        feats: list[list[torch.Tensor]] = []
        for j, (p, im) in enumerate(zip(batch, images)):
            lo = max(p.span.start, p.past_len)
            hi = p.span.start + p.span.length
            if hi > lo:
                assert im is not None
                x[j, lo - p.past_len: hi - p.past_len] = im.embeds[lo - p.span.start:].to(x.dtype)
                self.stats.image_tokens_prefilled += hi - lo
                if im.deepstack:
                    if mask is None:
                        mask = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device)
                        feats = [[] for _ in im.deepstack]
                    mask[j, lo - p.past_len: hi - p.past_len] = True
                    for f, layer in zip(im.deepstack, feats):
                        layer.append(f[lo - p.span.start:])
        if mask is None:
            return None
        return DeepStack(mask, tuple(torch.cat(f).to(x.dtype) for f in feats))

    def _positions(self, batch: list[Plan], t: int) -> torch.Tensor | None:
        """M-RoPE positions ``[3, B, T]`` of the batch's new tokens (each row's after its
        cached prefix; padding 0), or None for a family whose positions are the index."""
        if batch[0].prompt.positions is None:
            return None
        pos = torch.zeros((3, len(batch), t), dtype=torch.long)
        for j, p in enumerate(batch):
            assert p.prompt.positions is not None
            pos[:, j, : p.new_len] = p.prompt.positions[:, p.past_len:]
        if self.device.type == "cuda":
            pos = pos.pin_memory()
        return pos.to(self.device, non_blocking=True)

    def _texts(self, limits: list[int], logits: torch.Tensor, after: AfterPrefill
               ) -> list[Generated | None]:
        """Greedy (text, tokens) for the rows whose limit is > 0 (None for the others):
        ``_generate`` on those rows of the prefill's logits and KV only."""
        rows = [j for j, n in enumerate(limits) if n > 0]
        if not rows:
            return [None] * len(limits)
        if len(rows) < len(limits):  # a subset: its rows of everything (a copy)
            logits, after = logits[self.to_device(rows)], after.rows(self.to_device, rows)
        generated = self._generate(logits, after, [limits[j] for j in rows])
        texts: list[Generated | None] = [None] * len(limits)
        for j, text in zip(rows, generated):
            texts[j] = text
        return texts

    def _generate(self, logits: torch.Tensor, after: AfterPrefill,
                  limits: list[int]) -> list[Generated]:
        """Greedy decode after a prefill, batched; row j stops at an end token or after
        ``limits[j]`` tokens (all >= 1): its text and how many tokens it generated (the end
        token not counted).

        Keys are [past (padded to P) | new (padded to T) | generated]; ``valid`` masks the
        padding holes. Positions continue each row's own length, plus its prompt's rope
        delta (M-RoPE; 0 otherwise).
        """
        b = logits.shape[0]
        llm = self.model.llm
        kv, valid, pos = after.keys(self.to_device, llm)
        out: list[list[int]] = [[] for _ in range(b)]
        done = [False] * b
        tok = logits.argmax(-1)
        for _ in range(max(limits)):
            for j, t in enumerate(tok.tolist()):  # one device-to-host copy per step
                if not done[j]:
                    done[j] = t in self.stop_ids and not self.ignore_eos
                    if not done[j]:
                        out[j].append(t)
                        done[j] = len(out[j]) >= limits[j]
            if all(done):
                break
            x = self.model.llm.embed_tokens(tok)[:, None]  # [B, 1, D]
            step_logits, step_kv = llm.decode_step(x, pos, kv, valid)
            kv = llm.join_cache(kv, step_kv)
            valid = torch.cat([valid, torch.ones((b, 1), dtype=torch.bool,
                                                 device=self.device)], 1)
            pos += 1
            tok = step_logits.argmax(-1)
        dec = self.model.tokenizer.decode
        return [(dec(ids, skip_special_tokens=True), len(ids)) for ids in out]

    def _gather_past(self, batch: list[Plan]) -> tuple[list[KV] | None, torch.Tensor | None]:
        """Cached prefixes -> per layer (k, v) ``[B, K, P, d]``, P the longest prefix; one
        gather from the pool for the whole batch. Row j's keys past its own ``past_len``
        (another slot's or a padding slot's, all finite) are masked by ``past_lengths``.
        A hybrid decoder's linear layers get each row's state snapshot instead (zeros for a
        row without one, which then has no cached prefix either: ``Planner._resume``)."""
        longest = max(p.past_len for p in batch)
        if longest == 0:
            return None, None
        assert self.cache is not None
        past = self._gather_kv(batch, longest)
        if self.codec is not None:
            states = restore(self.cache, self.codec, batch, self.device)
            past = join_layers(self.kinds, past, states)
        return past, self.to_device([p.past_len for p in batch])

    def _gather_kv(self, batch: list[Plan], longest: int) -> list[KV]:
        """The pool's layers' (the full layers') cached K/V, ``[B, K, longest, d]`` each."""
        assert self.cache is not None
        nb = max(len(p.slots) for p in batch)
        fill = next(p.slots[0] for p in batch if p.slots)  # a slot in use: finite
        idx = self.to_device([p.slots + [fill] * (nb - len(p.slots)) for p in batch])
        pool = self.cache.pool  # [S, L, 2, K, bs, d]
        _, layers, _, kv_heads, bs, d = pool.shape
        g = pool[idx]  # [B, nb, L, 2, K, bs, d]
        g = g.permute(2, 3, 0, 4, 1, 5, 6).reshape(layers, 2, len(batch), kv_heads, nb * bs, d)
        g = g[..., :longest, :]
        return [(g[i, 0], g[i, 1]) for i in range(layers)]

    def _insert(self, batch: list[Plan], new_kv: list[KV],
                snaps: list[list[torch.Tensor]] | None) -> None:
        """New prefix blocks of the full layers' K/V into the pool, every block of the
        batch in one gather and one copy (``PrefixCache.claim``; entries dropped if the
        copy fails); a hybrid decoder's snapshots (``snaps``: per column, the states
        ``take_snapshots`` split off) of the rows that take them (``Plan.snapshots``) after.
        Row j's new token t is its prompt's position ``past_len + t``."""
        assert self.cache is not None
        if self.codec is not None:
            new_kv, _ = split_layers(self.kinds, new_kv)
        claimed: list[tuple[BlockKey, int, int, int, int]] = []  # key, slot, row, first, n
        try:  # an entry whose KV never got in must not stay (an error: out of memory, ...)
            for j, p in enumerate(batch):
                got = self.cache.claim([b for _, b in p.blocks])
                claimed += [(blk.key, slot, j, start - p.past_len, len(blk.ids))
                            for (start, blk), slot in zip(p.blocks, got) if slot >= 0]
                self.cache.touch(p.chain)
            if claimed:
                keys, slots, _, _, _ = zip(*claimed)
                held = self.cache.held(keys, slots)
                claimed = [c for c, ok in zip(claimed, held) if ok]
            if claimed:
                self._copy_blocks(new_kv, claimed, new_kv[0][0].shape[2])
        except BaseException:
            self.cache.drop([c[0] for c in claimed])
            raise
        if snaps is not None:
            assert self.codec is not None
            snapshot(self.cache, self.codec, batch, snaps)

    def _copy_blocks(self, new_kv: list[KV], claimed: list[tuple[BlockKey, int, int, int, int]],
                     t: int) -> None:
        """For each claimed (key, slot, row, first token, n): pool[slot] = that row's K/V of
        new tokens first..first + n, zeros after: one gather, one copy. new_kv: per layer
        (k, v) [B, K, T, d]."""
        assert self.cache is not None
        pool = self.cache.pool  # [S, L, 2, K, bs, d]
        bs = self.cache.block_size
        rows: list[int] = []
        toks: list[int] = []
        for _, _, j, lo, n in claimed:
            rows += [j] * bs
            toks += range(lo, lo + n)
            toks += [-1] * (bs - n)  # past the block: zeroed
        slots = [c[1] for c in claimed]
        kv = torch.stack([x for pair in new_kv for x in pair])  # [2L, B, K, T, d]
        where = self.to_device([rows, toks, slots + [0] * (len(rows) - len(slots))])
        tok = where[1]
        got = kv[:, where[0], :, tok.clamp(min=0)]  # [N, 2L, K, d]: the index dims first
        got = got.masked_fill((tok < 0)[:, None, None, None], 0)
        got = got.view(len(slots), bs, *pool.shape[1:4], pool.shape[5])  # [n, bs, L, 2, K, d]
        pool.index_copy_(0, where[2, : len(slots)], got.permute(0, 2, 3, 4, 1, 5))


def _row_positions(step: list[Row], prompts: list[Prompt], t: int) -> torch.Tensor:
    """M-RoPE positions ``[3, B, T]`` (host) of a step's rows: each token's in its own
    prompt (the tail's in the group's first prompt); padding 0."""
    pos = torch.zeros((3, len(step), t), dtype=torch.long)
    for j, r in enumerate(step):
        lead = r.plan.prompt.positions
        assert lead is not None
        parts = [lead[:, r.plan.past_len: r.shared]]
        parts += [prompts[i].positions[:, r.shared:] for i in r.members]  # type: ignore[index]
        row = torch.cat(parts, 1)
        pos[:, j, : row.shape[1]] = row
    return pos


def _chunks(sizes: list[int], budget: int) -> list[list[int]]:
    """Consecutive indices of ``sizes`` in groups of total <= ``budget`` (one item over it
    forms its own group)."""
    groups: list[list[int]] = [[]]
    total = 0
    for i, n in enumerate(sizes):
        if groups[-1] and total + n > budget:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return groups
