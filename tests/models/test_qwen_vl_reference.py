"""Whole Qwen-VL models against transformers: image -> our preprocessing -> our tower -> image
span of ``embed_tokens(ids)`` -> our positions -> our ``prefill`` / ``decode_step``.

The reference is ``...ForConditionalGeneration.forward`` / ``generate`` of the same random
checkpoint (fp32, CPU) on the same uint8 patches, normalised the image processor's way, with
the prompt built by hand: text, ``<|vision_start|>``, the image pad repeated once per image
token, ``<|vision_end|>``, text. Logits tolerance: max abs 1e-4 over the whole vocabulary row
(logits here are O(1): the test weights have a 0.1 spread). The last tests show that this
comparison catches a decoder bug (``fault_injection.py``) and that every constant-initialised
decoder parameter of the fixture matters.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tests.models.conftest import Pair
from tests.models.fault_injection import (
    FAULTS,
    HYBRID_FAULTS,
    constant_init_parameters,
    with_fault,
)
from tests.models.qwen_vl_helpers import EOS, IMAGE, KINDS, prompt_ids, reference_pixels
from vlmbatch.models.base import KV, DeepStack
from vlmbatch.models.qwen_vl.load import load_qwen_vl
from vlmbatch.models.qwen_vl.positions import batch_positions, prompt_positions
from vlmbatch.preprocessing.prepare import PreparedImage
from vlmbatch.preprocessing.qwen_vl import PatchGrid, prepare_qwen_vl

SIZES = [(56, 56), (200, 90), (30, 170), (300, 200), (120, 400)]  # (width, height)
TOL = 1e-4


def grid(im: PreparedImage) -> PatchGrid:
    assert isinstance(im.grid, PatchGrid)
    return im.grid


def image(pair: Pair, w: int, h: int, seed: int = 0) -> PreparedImage:
    rng = np.random.default_rng(seed)
    return prepare_qwen_vl(rng.integers(0, 256, (h, w, 3), dtype=np.uint8),
                           pair.ours.spec.preprocess)


def reference_inputs(pair: Pair, ids: list[int], im: PreparedImage) -> dict:
    v = pair.ours.spec.vision
    x = torch.tensor([ids])
    return dict(input_ids=x, mm_token_type_ids=(x == IMAGE).int(),
                pixel_values=reference_pixels(torch.from_numpy(im.rows), v.mean, v.std),
                image_grid_thw=torch.tensor([grid(im).thw]))


def reference_logits(pair: Pair, ids: list[int], im: PreparedImage) -> torch.Tensor:
    with torch.no_grad():
        return pair.ref(**reference_inputs(pair, ids, im)).logits[0, -1]


def our_inputs(pair: Pair, rows: list[tuple[list[int], PreparedImage]]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DeepStack | None, list[int]]:
    """A right-padded batch: (embeds [B, T, D], lengths [B], positions [3, B, T], DeepStack,
    rope deltas). One vision call for all the rows' images."""
    m = pair.ours
    t = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([r + [0] * (t - len(r)) for r, _ in rows])
    with torch.no_grad():
        vis = m.vision(torch.cat([torch.from_numpy(im.rows) for _, im in rows]),
                       [grid(im).thw for _, im in rows])
        x = m.text.embed_tokens(ids)
    at = ids == IMAGE
    x[at] = vis.embeds  # rows' image spans in row order = the images' outputs in order
    pos = [prompt_positions(r, IMAGE, grid(im).thw, m.spec.vision.merge) for r, im in rows]
    deep = DeepStack(at, vis.deepstack) if vis.deepstack else None
    return (x, torch.tensor([len(r) for r, _ in rows]), batch_positions([p for p, _ in pos]),
            deep, [d for _, d in pos])


def split_deepstack(deep: DeepStack | None, k: int) -> tuple[DeepStack | None, ...]:
    """The DeepStack input of tokens [:k] and [k:] of a one-row prompt."""
    if deep is None:
        return None, None
    n = int(deep.mask[:, :k].sum())
    return (DeepStack(deep.mask[:, :k], tuple(f[:n] for f in deep.features)),
            DeepStack(deep.mask[:, k:], tuple(f[n:] for f in deep.features)))


@pytest.mark.parametrize("w,h", SIZES)
def test_logits_match_transformers(pair: Pair, w: int, h: int) -> None:
    im = image(pair, w, h, seed=w)
    ids = prompt_ids(6, grid(im).tokens, 5, seed=h)
    x, lengths, pos, deep, _ = our_inputs(pair, [(ids, im)])
    with torch.no_grad():
        got, _ = pair.ours.text.prefill(x, lengths, positions=pos, deepstack=deep)
    assert (got[0] - reference_logits(pair, ids, im)).abs().max() <= TOL


# Qwen3-VL's decoder has no q/k/v biases (attention_bias false): only the head swap applies;
# Qwen3.5's has them (the fixture sets attention_bias), and its own faults (HYBRID_FAULTS)
DECODER_FAULTS = [(k, f) for k in KINDS for f in sorted(FAULTS)
                  if not (k == "qwen3_vl" and f == "no_qkv_biases")] + [
    ("qwen3_5", f) for f in sorted(HYBRID_FAULTS)]


@pytest.mark.parametrize("kind,fault", DECODER_FAULTS)
def test_decoder_fault_is_caught(pairs: dict[str, Pair], kind: str, fault: str) -> None:
    """``test_logits_match_transformers``'s comparison on our decoder with a bug injected
    misses by > 100x the tolerance. Measured max |logit difference| (no q/k/v biases;
    query heads 0 and 1 swapped in layer 0; max |logit| 2.3-3.3): Qwen2-VL 0.81, 0.47;
    Qwen2.5-VL 0.98, 0.99; Qwen3-VL -, 1.3 (our decoder as loaded: 1.3e-6 to 2.4e-6);
    Qwen3.5 (no attention gate, no linear decay; see the report for its figures)."""
    pair = pairs[kind]
    im = image(pair, 200, 90, seed=200)
    ids = prompt_ids(6, grid(im).tokens, 5, seed=90)
    x, lengths, pos, deep, _ = our_inputs(pair, [(ids, im)])
    text = with_fault(pair.ours.text, {**FAULTS, **HYBRID_FAULTS}[fault])
    with torch.no_grad():
        got, _ = text.prefill(x, lengths, positions=pos, deepstack=deep)
    assert (got[0] - reference_logits(pair, ids, im)).abs().max() > 100 * TOL


def test_every_constant_initialised_decoder_parameter_matters(pair: Pair) -> None:
    """Each decoder parameter transformers initialises to a constant (biases, norm weights,
    Qwen3-VL's q/k norms) is moved off it far enough that putting it back moves the logits
    by > 10x the tolerance (measured, the least of each kind: 0.010, 0.017 (k biases),
    0.050 (a k norm))."""
    im = image(pair, 200, 90, seed=200)
    ids = prompt_ids(6, grid(im).tokens, 5, seed=90)
    x, lengths, pos, deep, _ = our_inputs(pair, [(ids, im)])
    text = copy.deepcopy(pair.ours.text)
    small = {}
    with torch.no_grad():
        base, _ = text.prefill(x, lengths, positions=pos, deepstack=deep)
        for name, t, value in constant_init_parameters(text, layer_scale=1.0):
            keep = t.clone()
            t.fill_(value)
            moved = float((text.prefill(x, lengths, positions=pos, deepstack=deep)[0]
                           - base).abs().max())
            t.copy_(keep)
            if moved <= 10 * TOL:
                small[name] = moved
    assert not small, small


def test_controls_positions_and_deepstack_matter(pair: Pair) -> None:
    """Negative controls: 1-D positions (and, for Qwen3-VL, no DeepStack) change the logits
    far above the tolerance, so the parity test depends on both being right."""
    im = image(pair, 200, 90)
    ids = prompt_ids(6, grid(im).tokens, 5)
    x, lengths, pos, deep, _ = our_inputs(pair, [(ids, im)])
    flat = torch.arange(len(ids)).expand(3, 1, -1)
    with torch.no_grad():
        right, _ = pair.ours.text.prefill(x, lengths, positions=pos, deepstack=deep)
        wrong, _ = pair.ours.text.prefill(x, lengths, positions=flat, deepstack=deep)
        assert (right - wrong).abs().max() > 100 * TOL
        if deep is not None:
            bare, _ = pair.ours.text.prefill(x, lengths, positions=pos)
            assert (right - bare).abs().max() > 100 * TOL


# batched = alone up to float32 summation order: padding moves Qwen3.5's linear-attention
# chunk boundaries; 1.58e-5 measured on an AMX CPU (2026-12-06), 1e-5 held on AVX-512 ones. A
# row that reads another's tokens or state is off by O(0.1) or more.
BATCH_TOL = 5e-5


def test_batch_equals_each_alone(pair: Pair) -> None:
    a, b = image(pair, 300, 200, 1), image(pair, 30, 170, 2)
    rows = [(prompt_ids(3, grid(a).tokens, 4, seed=1), a),
            (prompt_ids(9, grid(b).tokens, 12, seed=2), b)]
    assert len(rows[0][0]) != len(rows[1][0])
    with torch.no_grad():
        x, lengths, pos, deep, _ = our_inputs(pair, rows)
        both, kv = pair.ours.text.prefill(x, lengths, positions=pos, deepstack=deep)
        for b, row in enumerate(rows):
            x1, l1, p1, d1, _ = our_inputs(pair, [row])
            alone, kv1 = pair.ours.text.prefill(x1, l1, positions=p1, deepstack=d1)
            assert (both[b] - alone[0]).abs().max() <= BATCH_TOL
            n = len(row[0])
            for (k, v), (k1, v1) in zip(kv, kv1):
                assert (k[b, :, :n] - k1[0]).abs().max() <= BATCH_TOL
                assert (v[b, :, :n] - v1[0]).abs().max() <= BATCH_TOL


def one_shot_and_split(pair: Pair, ids: list[int], im: PreparedImage,
                       k: int) -> tuple[torch.Tensor, list[KV], torch.Tensor, list[KV]]:
    x, lengths, pos, deep, _ = our_inputs(pair, [(ids, im)])
    head, tail = split_deepstack(deep, k)
    text = pair.ours.text
    with torch.no_grad():
        whole, kv = text.prefill(x, lengths, positions=pos, deepstack=deep)
        _, kv_a = text.prefill(x[:, :k], torch.tensor([k]), positions=pos[:, :, :k],
                               deepstack=head)
        split, kv_b = text.prefill(x[:, k:], lengths - k, kv_a, torch.tensor([k]),
                                   positions=pos[:, :, k:], deepstack=tail)
    return whole, kv, split, text.join_cache(kv_a, kv_b)  # K/V joined; a linear layer's state


def test_split_prefill_equals_one_shot(pair: Pair) -> None:
    """What the prefix cache does: prefill a prefix (through the image's end token, or at an
    arbitrary block boundary, even inside the image), then the rest after its KV (and, for
    Qwen3.5's linear layers, after the state the prefix left)."""
    im = image(pair, 300, 200, 3)
    ids = prompt_ids(20, grid(im).tokens, 40, seed=3)
    assert len(ids) > 64
    end = ids.index(IMAGE) + grid(im).tokens + 1
    for k in (end, 1, 16, 64, end - 3):
        whole, kv, split, kv_split = one_shot_and_split(pair, ids, im, k)
        assert (whole - split).abs().max() <= 1e-5, k
        for (k1, v1), (k2, v2) in zip(kv, kv_split):
            assert (k1 - k2).abs().max() <= 1e-5 and (v1 - v2).abs().max() <= 1e-5


def test_rows_after_cached_prefixes_of_different_lengths(pair: Pair) -> None:
    """A batch whose rows continue after cached prefixes of different lengths (past padded
    with large junk, which the mask must hide) equals each row's one-shot prefill. A linear
    layer's past is each row's state after its prefix (no padding to hide)."""
    ims = [image(pair, 200, 90, 4), image(pair, 56, 56, 5)]
    rows = [(prompt_ids(5, grid(im).tokens, 9, seed=4 + i), im) for i, im in enumerate(ims)]
    cut = [r.index(IMAGE) + grid(im).tokens + 1 for r, im in rows]  # through <|vision_end|>
    text, p = pair.ours.text, max(cut)
    d = text.spec.head_dim
    with torch.no_grad():
        past = [(torch.full((2, 2, p, d), 1e4), torch.full((2, 2, p, d), 1e4))
                for _ in text.layers]
        tails, want = [], []
        for b, (ids, im) in enumerate(rows):
            whole, kv, _, _ = one_shot_and_split(pair, ids, im, cut[b])
            want.append(whole[0])
            x, _, pos, deep, _ = our_inputs(pair, [(ids, im)])
            _, head = text.prefill(x[:, : cut[b]], torch.tensor([cut[b]]),
                                   positions=pos[:, :, : cut[b]],
                                   deepstack=split_deepstack(deep, cut[b])[0])
            for layer, (k, v) in enumerate(kv):
                if text.kinds[layer] == "linear":  # the state after the prefix, per row
                    if b == 0:
                        past[layer] = tuple(torch.cat([s] * 2) for s in head[layer])
                    for s, one in zip(past[layer], head[layer]):
                        s[b] = one[0]
                    continue
                past[layer][0][b, :, : cut[b]] = k[0, :, : cut[b]]
                past[layer][1][b, :, : cut[b]] = v[0, :, : cut[b]]
            x, _, pos, _, _ = our_inputs(pair, [(ids, im)])
            tails.append((x[0, cut[b]:], pos[:, 0, cut[b]:]))
        t = max(len(e) for e, _ in tails)
        x = torch.stack([torch.cat([e, e.new_zeros(t - len(e), e.shape[1])]) for e, _ in tails])
        pos = batch_positions([q for _, q in tails], t)
        got, _ = text.prefill(x, torch.tensor([len(e) for e, _ in tails]), past,
                              torch.tensor(cut), positions=pos)
    for b in range(2):
        assert (got[b] - want[b]).abs().max() <= 1e-5


def test_different_images_same_ids_give_different_kv(pair: Pair) -> None:
    """The 58.com prefix-cache bug: two images of one size have the same placeholder ids, but
    their KV (and answers) differ from the image span on; text before it is shared."""
    a, b = image(pair, 200, 90, 6), image(pair, 200, 90, 7)
    assert grid(a) == grid(b) and a.content_hash != b.content_hash
    ids = prompt_ids(6, grid(a).tokens, 5)
    start = ids.index(IMAGE)
    with torch.no_grad():
        out = [_prefill(pair, ids, im) for im in (a, b, a)]
    (la, kva), (lb, kvb), (la2, kva2) = out
    assert (la - lb).abs().max() > 1e-3
    end = start + grid(a).tokens
    text = pair.ours.text
    for layer in [i for i, kind in enumerate(text.kinds) if kind == "linear"]:
        assert (kva[layer][1] - kvb[layer][1]).abs().max() > 1e-4  # the image moves the state
        assert torch.equal(kva[layer][1], kva2[layer][1])
    full = [kv for kind, kv in zip(text.kinds, zip(kva, kvb, kva2)) if kind == "full"]
    for layer, ((ka, va), (kb, vb), (ka2, _)) in enumerate(full):
        if text.kinds[0] == "linear":  # Qwen3.5: layer 0 is linear, so no full layer's
            layer = 1  # k/v of a text token sees only that token
        assert torch.equal(ka[:, :, :start], kb[:, :, :start])
        # every image token's k and v differ; text after the image differs from the second
        # layer on (the first layer's k/v of a text token see only that token)
        differ = end if layer == 0 else len(ids)
        for x, y in ((ka, kb), (va, vb)):
            assert (x[:, :, start:differ] - y[:, :, start:differ]).abs().amax((0, 1, 3)).min() \
                > 1e-4
        assert torch.equal(ka, ka2)  # same image, same KV: what makes sharing it correct


def _prefill(pair: Pair, ids: list[int], im: PreparedImage) -> tuple[torch.Tensor, list[KV]]:
    x, lengths, pos, deep, _ = our_inputs(pair, [(ids, im)])
    return pair.ours.text.prefill(x, lengths, positions=pos, deepstack=deep)


def greedy(pair: Pair, rows: list[tuple[list[int], PreparedImage]], steps: int) -> list[list]:
    """Batched greedy decode: one padded prefill, then ``steps - 1`` decode steps with the
    padding holes of the prefill left in the cache (``key_valid``)."""
    text = pair.ours.text
    with torch.no_grad():
        x, lengths, pos, deep, deltas = our_inputs(pair, rows)
        logits, kv = text.prefill(x, lengths, positions=pos, deepstack=deep)
        valid = torch.arange(x.shape[1])[None, :] < lengths[:, None]
        out = [logits.argmax(-1)]
        for step in range(1, steps):
            position = lengths + step - 1 + torch.tensor(deltas)  # seq index + rope delta
            logits, new = text.decode_step(text.embed_tokens(out[-1])[:, None], position, kv,
                                           valid)
            kv = text.join_cache(kv, new)
            valid = torch.cat([valid, torch.ones(len(rows), 1, dtype=torch.bool)], 1)
            out.append(logits.argmax(-1))
    return torch.stack(out, 1).tolist()


def test_greedy_decode_matches_generate(pair: Pair) -> None:
    a, b = image(pair, 120, 400, 8), image(pair, 56, 56, 9)
    rows = [(prompt_ids(4, grid(a).tokens, 3, seed=8), a),
            (prompt_ids(7, grid(b).tokens, 10, seed=9), b)]
    ours = greedy(pair, rows, 6)
    for (ids, im), got in zip(rows, ours):
        with torch.no_grad():
            out = pair.ref.generate(**reference_inputs(pair, ids, im), max_new_tokens=6,
                                    do_sample=False)
        want = out[0, len(ids):].tolist()
        assert got[: len(want)] == want
        assert len(want) == 6 or want[-1] == EOS
    assert len({t for row in ours for t in row}) > 2  # the random model does vary its output


def test_bfloat16_runs_close_to_float32(pair: Pair) -> None:
    """A dtype smoke test (the GPU's dtype, on the CPU): the whole path runs in bf16 and stays
    near fp32. Measured max |bf16 - fp32| 0.023-0.032 on logits of max |.| 2.6-3.6."""
    b16 = Pair(pair.path, pair.ref, load_qwen_vl(pair.path, dtype=torch.bfloat16))
    im = image(pair, 300, 200, 1)
    ids = prompt_ids(6, grid(im).tokens, 5)
    out = []
    for p in (pair, b16):
        x, lengths, pos, deep, _ = our_inputs(p, [(ids, im)])
        assert x.dtype == p.ours.text.embed_tokens.weight.dtype
        with torch.no_grad():
            out.append(p.ours.text.prefill(x, lengths, positions=pos, deepstack=deep)[0])
    assert out[1].dtype == torch.float32
    assert (out[0] - out[1]).abs().max() <= 0.1
