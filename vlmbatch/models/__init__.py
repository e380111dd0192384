"""Model families behind one interface (``models/base.py``), found by ``model_type``
(``models/registry.py``): importing this package registers every family. Shared layers
(``layers.py``), the one text decoder every family builds from its spec (``decoder.py``),
checkpoint reading (``io.py``), our BPE tokenizers (``tokenizer.py``) and embedding
declarations (``embedding.py``) live here once; each family is a folder (``internvl/``,
``qwen_vl/``)."""

from vlmbatch.models.internvl import family as _internvl  # noqa: F401  (registers the family)
from vlmbatch.models.qwen_vl import family as _qwen_vl  # noqa: F401  (registers the family)
from vlmbatch.models.registry import FAMILIES, family_for

__all__ = ["FAMILIES", "family_for"]
