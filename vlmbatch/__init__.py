"""vlmbatch: ask a vision-language model yes/no questions about very many images, and turn
images and texts into embeddings.

The app layer: the command line (``cli.py``, ``commands.py``, ``cli_args.py``, ``embed_cli.py``)
and the Python API (``api.py``: ``VLM``; ``maxsim``), thin layers over ``jobs/`` and
``pipeline/`` so that both behave alike. See the README for both.
"""

from pipeline.config import DEFAULT_EMBED_MODEL as EMBED_MODEL
from pipeline.config import DEFAULT_QWEN_MODEL as QWEN_MODEL
from pipeline.pooling import maxsim
from pipeline.records import Answer, Embedding, EmbedItem, ErrorKind, ImageItem, Question
from vlmbatch.api import VLM

__all__ = ["EMBED_MODEL", "QWEN_MODEL", "VLM", "Answer", "EmbedItem", "Embedding", "ErrorKind",
           "ImageItem", "Question", "maxsim"]
