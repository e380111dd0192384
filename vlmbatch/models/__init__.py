"""Model families behind one interface (``base.py``), found by ``model_type``
(``registry.py``: names to ``"module:attr"``, so importing this package imports no family;
``family_for`` imports the one a checkpoint needs). Shared layers (``layers.py``), the one
text decoder every family builds from its spec (``decoder.py``), checkpoint reading
(``io.py`` weights, ``config_io.py`` JSON files and ``ModelError``), our BPE tokenizers
(``tokenizer.py``) and embedding declarations (``embedding.py``) live here once; each family
is a folder (``internvl/``, ``qwen_vl/``)."""

from vlmbatch.models.registry import FAMILIES, family_for

__all__ = ["FAMILIES", "family_for"]
