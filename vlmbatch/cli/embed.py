"""``vlmbatch embed``: texts, images or a manifest -> embeddings (JSONL, Parquet, .npy), the
cosine-similarity matrix (``-sim``), late-interaction scores (``--maxsim``) or the retrieval
evaluation (``--eval``).

    vlmbatch embed "a red circle" "a blue square"        # one JSON line per text
    printf 'a\\nb\\n' | vlmbatch embed -sim               # texts from stdin, 4-decimal matrix
    vlmbatch embed --images a.jpg b.png -o vecs.npy
    vlmbatch embed --manifest m.jsonl -o vecs.parquet     # {"id", "image"?, "text"?} lines
    vlmbatch embed --maxsim queries.txt docs.jsonl        # multi-vector MaxSim matrix
    vlmbatch embed --eval                                 # easy-vqa test retrieval figures

The command runs here (``run_embed``, given the model and engine configs ``commands.py``
builds), through the same drive loop as the Python API and jobs (``pipeline/drive.py`` with
``pipeline.task.EmbedTask``): one behaviour for all three, each image decoded in a decoder
process under ``--decode-timeout``. Its options are declared on ``EmbedCommandConfig``
(``cli/config.py``) and ``EmbedConfig`` (shared with ``submit --task embed``); ``results`` of
an embedding job is ``commands.embed_results``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from vlmbatch.cli.config import EmbedCommandConfig
from vlmbatch.cli.embed_eval import evaluate_retrieval
from vlmbatch.common.atomic import replaced_on_success
from vlmbatch.engine.build import build_engine
from vlmbatch.engine.config import ConfigError
from vlmbatch.engine.embed import EmbedHandle, build_embedder
from vlmbatch.engine.pooling import maxsim
from vlmbatch.inputs.embed_input import (
    folder_items,
    image_items,
    read_embed_manifest,
    text_items,
)
from vlmbatch.outputs.embed_sinks import (
    EmbeddingSink,
    JsonlSink,
    NpySink,
    ParquetSink,
    embed_format_of,
)
from vlmbatch.pipeline.config import PrepareOptions
from vlmbatch.pipeline.drive import drive, groups_of
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.pipeline.records import Embedding, EmbedItem
from vlmbatch.pipeline.task import EmbedTask


def inputs_of(cfg: EmbedCommandConfig) -> list[EmbedItem]:
    """The command line's inputs: texts, --images or --manifest (none: standard input)."""
    if cfg.manifest is not None:
        return read_embed_manifest(cfg.manifest)
    if cfg.images is not None:
        if len(cfg.images) == 1 and Path(cfg.images[0]).is_dir():
            return folder_items(Path(cfg.images[0]))
        return image_items(list(cfg.images))
    return text_items(list(cfg.texts) or [line.rstrip("\r\n") for line in sys.stdin
                                          if line.strip()])


def embed_items(embedder: EmbedHandle, items: list[EmbedItem], images_per_batch: int,
                opts: PrepareOptions, hooks: FaultHooks = NO_HOOKS) -> Iterator[list[Embedding]]:
    """The items' embeddings, a group at a time, in order (the drive loop)."""
    for _, results in drive(EmbedTask(embedder.cfg), embedder.engine,
                            groups_of(items, images_per_batch), opts, hooks=hooks):
        yield [e for per_item in results for e in per_item]


def run_embed(cfg: EmbedCommandConfig, hooks: FaultHooks = NO_HOOKS) -> int:
    """The ``embed`` command; exit 0, or 3 when some inputs could not be embedded."""
    sides = (_side(cfg.maxsim[0]), _side(cfg.maxsim[1])) if cfg.maxsim else None
    items = [] if cfg.eval or sides else inputs_of(cfg)  # all read before the model loads
    embedder = build_embedder(build_engine(cfg.model, cfg.engine, cfg.threads),
                              cfg.embed_config)
    if not embedder.resolved.spec.declared:
        print(f"vlmbatch: note: {cfg.model.model_dir} declares no embedding pooling: a chat "
              "model's pooled hidden states are weak embeddings (the default model of `embed` "
              "is the built-in embedding model)", file=sys.stderr)
    opts = cfg.prepare.options(cfg.model.device)
    if cfg.eval:
        print(evaluate_retrieval(embedder, limit=cfg.limit, opts=opts).text())
        return 0
    if sides is not None:
        return _print_maxsim(embedder, sides, cfg, opts)
    batches = embed_items(embedder, items, cfg.images_per_batch, opts, hooks)
    failed = _write(batches, cfg.out, len(items)) if not cfg.sim else _print_sim(batches)
    if failed:
        print(f"vlmbatch: {failed} of {len(items)} inputs could not be embedded (their "
              "lines carry error)", file=sys.stderr)
    return 3 if failed else 0


def _write(batches: Iterator[list[Embedding]], out: Path | None, n: int) -> int:
    """Write to ``out`` (JSONL streamed; Parquet and .npy whole or not at all); failures."""
    fmt = embed_format_of(out)
    if out is None:
        return _drain(batches, JsonlSink(sys.stdout))
    if fmt == "jsonl":
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            return _drain(batches, JsonlSink(f))
    with replaced_on_success(out) as part:
        sink: EmbeddingSink = ParquetSink(part) if fmt == "parquet" else NpySink(part, n)
        return _drain(batches, sink)


def _drain(batches: Iterator[list[Embedding]], sink: EmbeddingSink) -> int:
    failed = 0
    for group in batches:
        sink.write(group)
        failed += sum(e.vector is None for e in group)
    sink.close()
    return failed


def _print_sim(batches: Iterator[list[Embedding]]) -> int:
    out = [e for group in batches for e in group]
    bad = [e for e in out if e.vector is None]
    if bad:
        raise ConfigError(f"-sim: input {bad[0].index} could not be embedded: {bad[0].error}")
    v = np.stack([e.vector for e in out if e.vector is not None])
    if v.ndim != 2:
        raise ConfigError("-sim compares pooled vectors; drop --multi-vector (or use --maxsim)")
    for row in v @ v.T:
        print(" ".join(f"{x:.4f}" for x in row))
    return 0


def _side(p: Path) -> list[EmbedItem]:
    """A --maxsim side: a text file (one per line) or a JSONL manifest."""
    if p.suffix == ".jsonl":
        return read_embed_manifest(p)
    if not p.is_file():
        raise ConfigError(f"--maxsim: {p} not found")
    return text_items([t for t in p.read_text(encoding="utf-8").splitlines() if t.strip()])


def _vectors(embedder: EmbedHandle, items: list[EmbedItem], cfg: EmbedCommandConfig,
             opts: PrepareOptions) -> list[np.ndarray]:
    out = [e for g in embed_items(embedder, items, cfg.images_per_batch, opts) for e in g]
    for e in out:
        if e.vector is None:
            raise ConfigError(f"--maxsim: input {e.index} could not be embedded: {e.error}")
    return [e.vector for e in out if e.vector is not None]


def _print_maxsim(embedder: EmbedHandle, sides: tuple[list[EmbedItem], list[EmbedItem]],
                  cfg: EmbedCommandConfig, opts: PrepareOptions) -> int:
    """QUERIES x DOCS MaxSim scores, 4 decimals; DOCS' texts take the document prefix."""
    docs = EmbedHandle(embedder.engine, dataclasses.replace(
        embedder.cfg, query_prefix=embedder.cfg.document_prefix))
    scores = maxsim(_vectors(embedder, sides[0], cfg, opts),
                    _vectors(docs, sides[1], cfg, opts))
    for row in scores:
        print(" ".join(f"{x:.4f}" for x in row))
    return 0
