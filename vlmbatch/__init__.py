"""vlmbatch: ask a vision-language model yes/no questions about very many images.

The app layer: the command line (``cli.py``, ``commands.py``, ``cli_args.py``) and the
Python API (``api.py``: ``VLM``), thin layers over ``jobs/`` and ``pipeline/`` so that both
behave alike. See the README for both.
"""

from pipeline.records import Answer, ErrorKind, ImageItem, Question
from vlmbatch.api import VLM

__all__ = ["VLM", "Answer", "ErrorKind", "ImageItem", "Question"]
