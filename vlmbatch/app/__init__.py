"""The app layer: the command line (``cli.py`` errors and exit codes; ``commands.py`` the
commands by name as ``"module:attr"`` and those that need no model, ``model_commands.py``
those that load one, ``label_commands.py`` ``calibrate`` and ``report``; ``args.py``,
``embed_args.py`` and ``label_args.py`` the parser, light: ``--help`` and ``status`` import
no torch; ``config.py`` the commands' config roots; ``embed_cli.py`` the ``embed`` command), the
Python API (``api.py``: ``VLM``) and the OpenAI-compatible server (``server/``): thin layers
over ``vlmbatch.jobs`` and ``vlmbatch.pipeline`` so that all three behave alike. The package
itself imports nothing."""
