"""The ``embed`` command's parser (``add_embed_parser``) and the embedding options that
``submit --task embed`` shares (``embed_option_args``: the ``EmbedConfig`` fields, by
name). Defaults are the config's; light, as every parser module is: the command itself runs
in ``embed_cli.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from vlmbatch.engine.config import EMBED_GROUP, EmbedConfig
from vlmbatch.models.embedding import POOLINGS
from vlmbatch.preprocessing.limits import DEFAULT_MAX_PIXELS

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
