"""Model families behind one interface (``base.py``), found by ``model_type``
(``registry.py``: names to ``"module:attr"``, so importing this package imports no family;
``family_for`` imports the one a checkpoint needs). Shared layers (``layers.py``), the one
text decoder every family builds from its spec (``decoder.py``; its Gated DeltaNet
linear-attention layers in ``linear_attention.py``), checkpoint reading
(``io.py`` weights, ``config_io.py`` JSON files and ``ModelError``, ``fingerprint.py`` a
checkpoint's identity: its files' hash, dtype, quantisation), the chat template cut
into the pieces a prompt builder tokenizes (``chat.py``: system turn, image, question, the
assistant answer's lead), our BPE tokenizers
(``tokenizer.py``) and embedding declarations (``embedding.py``) live here once; each family
is a folder (``internvl/``, ``qwen_vl/``). The built-in checkpoints are folders here too
(``default_model/``, ``default_qwen_model/``, ``default_embed_model/``: weights trained by
``scripts/``), named in ``paths.py``."""

from vlmbatch.models.registry import FAMILIES, family_for

__all__ = ["FAMILIES", "family_for"]
