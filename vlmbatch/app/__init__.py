"""The app layer: the command line (``cli.py`` errors and exit codes, ``args.py`` the commands
and their parsers, derived from the options the configs declare on their fields,
``commands.py`` the command table and the commands that need no model, ``model_commands.py``
those that load one, ``label_commands.py`` ``calibrate`` and ``report``, ``embed_cli.py`` the
``embed`` command; ``--help`` and ``status`` import no torch), each command's config root
(``config.py``), the command drivers
that run a model for a figure (``evaluate.py``: easy-vqa accuracy and a labelled manifest's
evaluation; ``embed_eval.py``: easy-vqa retrieval; ``quantize.py``: AWQ/GPTQ calibration on
the serving engine), the Python API (``api.py``: ``VLM``), the Ray Data stages over it
(``ray_data.py``: ``Answerer``, ``Preparer``, ``Embedder`` for ``Dataset.map_batches``) and
the OpenAI-compatible server (``server/``): thin layers over ``vlmbatch.jobs`` and
``vlmbatch.pipeline`` so that all of them behave alike. The package itself imports nothing."""
