"""Image and clip preprocessing: bytes to the uint8 rows a vision module takes. Never touches
models.

- ``sources.py``: an image's bytes from a path, ``file://`` or ``data:`` URL (``SourceError``),
  and which sources the fetch stage reads; ``fetch.py``: the fetch stage (http(s) through one
  pooled httpx client, s3/gs/az through fsspec, table rows (``table_rows.py``: a Parquet/Arrow
  cell by row) and tar shard members by byte range), many at once; ``guard.py``: its SSRF
  guard (a server's remote media: every connection's addresses checked, then pinned);
- ``decode.py``: bytes -> RGB pixels as Pillow's ``convert("RGB")`` gives them (EXIF, alpha,
  gray, 16-bit, CMYK), large JPEGs decoded reduced in the DCT domain, the decompression-bomb
  guard (``limits.py``: the default pixel and clip-length limits, light);
- ``resize.py``: the resize kernels, one function for images and frames: our OpenCV policy
  (INTER_AREA when shrinking, INTER_CUBIC when enlarging) and, under ``--resize reference``,
  the family's transformers processor's (torchvision's or Pillow's bicubic;
  ``resize_torch.py``: torchvision's, through torch, imported only when used);
- ``tiling.py``: InternVL's tile grids (the reference ``dynamic_preprocess`` and the reduced
  one); ``prepare.py``: the ``PreparedImage`` record, image plans (``TilingConfig``) and the
  content hash; ``media.py``: the records of a sampled clip (``PreparedVideo``) and of an
  item's visual parts; ``qwen_vl.py``: Qwen-VL's smart resize and patch rows (``qwen2vl.py``: its
  resize grid);
- clips: ``video.py`` (PyAV: a clip's metadata from its packets, frames decoded as sampled,
  the display matrix applied, ``VideoError`` with a reason), ``video_sampling.py`` (the frame
  indices of transformers' Qwen2-VL, Qwen3-VL and InternVL video processors),
  ``video_rows.py`` (frames -> Qwen-VL patch rows / InternVL tiles, a ``PreparedVideo``),
  ``video_plan.py`` (a family's ``VideoPlan``, read from a checkpoint as transformers reads
  it); ``video_budget.py`` (a clip's token budget and the model's context as limits);
  ``video_source.py`` (``VideoSource``: a clip for the decoder processes, light);
  ``video_windows.py`` (a long clip's windows, each sampled as a clip of its span);
- ``isolated.py`` and ``decoder_process.py``: decoder processes, each image (or clip) under
  a deadline, a crash that item's error (started as ``common/children.py``
  starts every child interpreter);
- ``reference.py``: the Pillow reference pipeline of InternVL's model card (benchmarks and
  tests today; kept in the package because issue 44 makes it a run mode, ``--resize
  reference``).
"""
