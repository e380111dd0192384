"""Model families behind one interface (``models/base.py``), found by ``model_type``
(``models/registry.py``: names to ``"module:attr"``, so importing this package imports no
family; ``family_for`` imports the one a checkpoint needs). Shared layers (``layers.py``),
the Qwen2 decoder (``qwen2.py``) and checkpoint reading (``io.py`` weights, ``config_io.py``
JSON files and ``ModelError``) live here once; each family is a folder (``internvl/``,
``qwen_vl/``)."""

from vlmbatch.models.registry import FAMILIES, family_for

__all__ = ["FAMILIES", "family_for"]
