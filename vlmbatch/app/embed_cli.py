"""``vlmbatch embed``: texts, images or a manifest -> embeddings (JSONL, Parquet, .npy), the
cosine-similarity matrix (``-sim``), late-interaction scores (``--maxsim``) or the retrieval
evaluation (``--eval``); and the embedding options ``submit --task embed`` shares.

    vlmbatch embed "a red circle" "a blue square"        # one JSON line per text
    printf 'a\\nb\\n' | vlmbatch embed -sim               # texts from stdin, 4-decimal matrix
    vlmbatch embed --images a.jpg b.png -o vecs.npy
    vlmbatch embed --manifest m.jsonl -o vecs.parquet     # {"id", "image"?, "text"?} lines
    vlmbatch embed --maxsim queries.txt docs.jsonl        # multi-vector MaxSim matrix
    vlmbatch embed --eval                                 # easy-vqa test retrieval figures

The parser is built here (``add_embed_parser``), the command runs here (``run_embed``, given
the model and engine configs ``commands.py`` builds), through the same drive loop as the
Python API and jobs (``pipeline/drive.py`` with ``pipeline.task.EmbedTask``): one behaviour
for all three, each image decoded in a decoder process under ``--decode-timeout``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from vlmbatch.common.atomic import replaced_on_success
from vlmbatch.jobs.config import ExecutorConfig
from vlmbatch.jobs.embed_input import (
    folder_items,
    image_items,
    read_embed_manifest,
    text_items,
)
from vlmbatch.jobs.embed_sinks import (
    EmbeddingSink,
    JsonlSink,
    NpySink,
    ParquetSink,
    embed_format_of,
)
from vlmbatch.jobs.export import export_embed_requests, export_embeddings, recorded_results
from vlmbatch.jobs.folder import job_format
from vlmbatch.jobs.sinks import check_writable, format_of, naming
from vlmbatch.models.embedding import POOLINGS
from vlmbatch.pipeline.build import build_engine
from vlmbatch.pipeline.config import (
    DEFAULT_EMBED_MODEL,
    ConfigError,
    EmbedConfig,
    EngineConfig,
    ModelConfig,
    PrepareOptions,
    preprocess_threads_for,
)
from vlmbatch.pipeline.drive import drive, groups_of
from vlmbatch.pipeline.embed import Embedder, build_embedder
from vlmbatch.pipeline.embed_eval import evaluate_retrieval
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.pipeline.pooling import maxsim
from vlmbatch.pipeline.records import Embedding, EmbedItem
from vlmbatch.pipeline.task import EMBED_GROUP, EmbedTask
from vlmbatch.preprocessing.decode import DEFAULT_MAX_PIXELS

E = EmbedConfig()  # the defaults


def embed_option_args(p: argparse.ArgumentParser) -> None:
    """The ``EmbedConfig`` options (``embed`` and ``submit --task embed``)."""
    g = p.add_argument_group("embeddings")
    g.add_argument("--pooling", default=E.pooling, choices=POOLINGS,
                   help="image-mean: an image's hidden states over <img>..</img>, a text's "
                   "over its tokens (jina-embeddings-v4); mean: every token; last: the last "
                   "token (GME/VLM2Vec). Default: the checkpoint's, else its family's")
    g.add_argument("--dimensions", type=int, default=E.dimensions,
                   help="Matryoshka: keep the first N components, re-normalised (N must be "
                   "one of the checkpoint's matryoshka_dims)")
    g.add_argument("--force-dimensions", action="store_true",
                   help="--dimensions even where the checkpoint declares no such size")
    g.add_argument("--multi-vector", action=argparse.BooleanOptionalAction,
                   default=E.multi_vector,
                   help="one unit vector per token (after the checkpoint's projection layer); "
                   "default: the checkpoint's (a ColQwen2 one: yes, unless --pooling or "
                   "--dimensions is given)")
    g.add_argument("--prompt", default=E.prompt,
                   help="text after the image of an image-only input (default: the family's, "
                   "'Describe the image.')")
    g.add_argument("--query-prefix", default=E.query_prefix,
                   help="put before every text-only input, as given (e.g. 'Query: ')")
    g.add_argument("--document-prefix", default=E.document_prefix,
                   help="put before the text of inputs with an image, and of --maxsim DOCS")


def embed_config(a: argparse.Namespace) -> EmbedConfig:
    return EmbedConfig(a.pooling, a.dimensions, a.force_dimensions, a.multi_vector, a.prompt,
                       a.query_prefix, a.document_prefix)


def add_embed_parser(sub: argparse._SubParsersAction,
                     model_args: Callable[[argparse.ArgumentParser], None],
                     decode_timeout_arg: Callable[[argparse.ArgumentParser], None]) -> None:
    """``embed`` with the model/engine options and ``--decode-timeout`` the two functions
    add (``args.py``'s)."""
    e = sub.add_parser("embed", help="texts, images or a manifest -> embeddings (JSONL, "
                       "Parquet, .npy), -sim, --maxsim, --eval",
                       description="Unit vectors for texts (arguments, else standard input, "
                       "one per line), image files (--images) or a JSONL manifest of {\"id\", "
                       "\"image\"?, \"text\"?} (--manifest); default model: the built-in "
                       "embedding model. docs/embeddings.md.")
    e.add_argument("texts", nargs="*", help="texts to embed")
    e.add_argument("--images", type=Path, nargs="+", help="image files (or one folder)")
    e.add_argument("--manifest", type=Path, help='JSONL: {"id", "image"?, "text"?} per line')
    e.add_argument("--out", "-o", type=Path, help="JSONL (default, standard output), .parquet "
                   "or .npy")
    e.add_argument("-sim", "--sim", action="store_true",
                   help="print the cosine-similarity matrix (input order, 4 decimals)")
    e.add_argument("--maxsim", type=Path, nargs=2, metavar=("QUERIES", "DOCS"),
                   help="late-interaction (MaxSim) scores of multi-vector embeddings: each a "
                   "text file (one per line) or a JSONL manifest; prints a QUERIES x DOCS "
                   "matrix")
    e.add_argument("--eval", action="store_true",
                   help="text->image precision@10 and image->image top-1 on easy-vqa's test "
                   "images")
    e.add_argument("--limit", type=int, default=None, help="--eval: first N labelled images")
    e.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS,
                   help="images with more pixels are that input's error (default %(default)s)")
    decode_timeout_arg(e)
    embed_option_args(e)
    model_args(e)
    e.set_defaults(images_per_batch=EMBED_GROUP)  # inputs per embedder call


def inputs_of(a: argparse.Namespace) -> list[EmbedItem]:
    """The command line's inputs: exactly one of texts, --images, --manifest (none: stdin)."""
    given = [x for x in (a.texts or None, a.images, a.manifest) if x is not None]
    if len(given) > 1:
        raise ConfigError("give texts, --images or --manifest, not several")
    if a.manifest is not None:
        return read_embed_manifest(a.manifest)
    if a.images is not None:
        if len(a.images) == 1 and a.images[0].is_dir():
            return folder_items(a.images[0])
        return image_items(a.images)
    return text_items(a.texts or [line.rstrip("\r\n") for line in sys.stdin if line.strip()])


def embed_items(embedder: Embedder, items: list[EmbedItem], images_per_batch: int,
                opts: PrepareOptions, hooks: FaultHooks = NO_HOOKS) -> Iterator[list[Embedding]]:
    """The items' embeddings, a group at a time, in order (the drive loop)."""
    for _, results in drive(EmbedTask(embedder.cfg), embedder.engine,
                            groups_of(items, images_per_batch), opts, hooks=hooks):
        yield [e for per_item in results for e in per_item]


def prepare_options(a: argparse.Namespace, device: str) -> PrepareOptions:
    """Stage 1 of ``embed`` as its options say (decoder processes under --decode-timeout)."""
    return PrepareOptions(a.max_pixels, preprocess_threads_for(a.preprocess_threads, device),
                          ExecutorConfig(decode_timeout=a.decode_timeout).decode_timeout)


def run_embed(a: argparse.Namespace, model: ModelConfig, engine: EngineConfig,
              hooks: FaultHooks = NO_HOOKS) -> int:
    """The ``embed`` command; exit 0, or 3 when some inputs could not be embedded."""
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.model is None:  # the built-in embedding model, not the chat one
        model = dataclasses.replace(model, path=DEFAULT_EMBED_MODEL)
    cfg = embed_config(a)
    if a.maxsim:
        cfg = dataclasses.replace(cfg, multi_vector=True)
    sides = (_side(a.maxsim[0]), _side(a.maxsim[1])) if a.maxsim else None
    items = [] if a.eval or sides else inputs_of(a)  # all read before the model loads
    embedder = build_embedder(build_engine(model, engine), cfg)
    if not embedder.resolved.spec.declared:
        print(f"vlmbatch: note: {model.model_dir} declares no embedding pooling: a chat "
              "model's pooled hidden states are weak embeddings (the default model of `embed` "
              "is the built-in embedding model)", file=sys.stderr)
    opts = prepare_options(a, model.device)
    if a.eval:
        print(evaluate_retrieval(embedder, limit=a.limit, opts=opts).text())
        return 0
    if sides is not None:
        return _print_maxsim(embedder, sides, a, opts)
    batches = embed_items(embedder, items, a.images_per_batch, opts, hooks)
    failed = _write(batches, a, len(items)) if not a.sim else _print_sim(batches)
    if failed:
        print(f"vlmbatch: {failed} of {len(items)} inputs could not be embedded (their "
              "lines carry error)", file=sys.stderr)
    return 3 if failed else 0


def embed_results(a: argparse.Namespace) -> int:
    """An embedding job's vectors: JSONL (standard output without -o), Parquet or .npy; a job
    of OpenAI embedding requests gives OpenAI batch output lines as its JSONL."""
    fmt = a.format or ("csv" if format_of(a.out) == "csv" else embed_format_of(a.out))
    if fmt == "csv":
        raise ConfigError("an embedding job's results are vectors: JSONL, Parquet or .npy")
    if fmt != "jsonl" and a.out is None:
        raise ConfigError(f"--format {fmt} needs --out FILE.{fmt}")
    openai = fmt == "jsonl" and job_format(a.job) == "openai"  # OpenAI output lines
    if a.out is None:
        n = (export_embed_requests(a.job, sys.stdout) if openai
             else export_embeddings(a.job, JsonlSink(sys.stdout)))
    else:  # all or nothing, errors naming --out (as a yes/no job's `results`)
        check_writable(a.out)
        with naming(a.out), replaced_on_success(a.out) as part:
            if fmt == "jsonl":
                with open(part, "w", encoding="utf-8") as f:
                    n = (export_embed_requests(a.job, f) if openai
                         else export_embeddings(a.job, JsonlSink(f)))
            else:
                n = export_embeddings(a.job, ParquetSink(part) if fmt == "parquet"
                                      else NpySink(part, recorded_results(a.job)))
    print(f"vlmbatch: {n} {'requests' if openai else 'embeddings'}", file=sys.stderr)
    return 0


def _write(batches: Iterator[list[Embedding]], a: argparse.Namespace, n: int) -> int:
    """Write to --out (JSONL streamed; Parquet and .npy whole or not at all); failures."""
    fmt = embed_format_of(a.out)
    if a.out is None:
        return _drain(batches, JsonlSink(sys.stdout))
    if fmt == "jsonl":
        a.out.parent.mkdir(parents=True, exist_ok=True)
        with open(a.out, "w", encoding="utf-8") as f:
            return _drain(batches, JsonlSink(f))
    with replaced_on_success(a.out) as part:
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


def _vectors(embedder: Embedder, items: list[EmbedItem], a: argparse.Namespace,
             opts: PrepareOptions) -> list[np.ndarray]:
    out = [e for g in embed_items(embedder, items, a.images_per_batch, opts) for e in g]
    for e in out:
        if e.vector is None:
            raise ConfigError(f"--maxsim: input {e.index} could not be embedded: {e.error}")
    return [e.vector for e in out if e.vector is not None]


def _print_maxsim(embedder: Embedder, sides: tuple[list[EmbedItem], list[EmbedItem]],
                  a: argparse.Namespace, opts: PrepareOptions) -> int:
    """QUERIES x DOCS MaxSim scores, 4 decimals; DOCS' texts take the document prefix."""
    docs = Embedder(embedder.engine, dataclasses.replace(
        embedder.cfg, query_prefix=embedder.cfg.document_prefix))
    scores = maxsim(_vectors(embedder, sides[0], a, opts), _vectors(docs, sides[1], a, opts))
    for row in scores:
        print(" ".join(f"{x:.4f}" for x in row))
    return 0
