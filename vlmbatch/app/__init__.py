"""The app layer: the command line (``cli.py`` errors and exit codes, ``commands.py`` one
function per command, ``args.py`` the parser, ``embed_cli.py`` the ``embed`` command), the
Python API (``api.py``: ``VLM``) and the OpenAI-compatible server (``server/``): thin layers
over ``vlmbatch.jobs`` and ``vlmbatch.pipeline`` so that all three behave alike. The package
itself imports nothing."""
