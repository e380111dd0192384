"""The decompression-bomb guard's default, apart from the decoder (``decode.py``: OpenCV,
Pillow, numpy) so that the configs that default to it (``jobs.config.RunConfig``, the
server's) and the CLI's ``--help`` import none of those."""

DEFAULT_MAX_PIXELS = 100_000_000  # 100 MP: a 10000 x 10000 image
