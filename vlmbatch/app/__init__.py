"""The app layer: the command line (``cli.py`` errors and exit codes, ``args.py`` the
parser, ``commands.py`` the command table and the commands that need no model,
``model_commands.py`` those that load one, ``embed_args.py`` and ``embed_cli.py`` the
``embed`` command), each command's config root (``config.py``), the Python API (``api.py``:
``VLM``) and the OpenAI-compatible server (``server/``): thin layers over ``vlmbatch.jobs``
and ``vlmbatch.pipeline`` so that all three behave alike. The package itself imports
nothing."""
