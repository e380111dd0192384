"""The command line: parsing (``main.py``: ``main``, errors and exit codes; ``args.py``: the
commands and their parsers, derived from the options the configs declare on their fields;
``--help`` and ``status`` import no torch), each command's config root (``config.py``), the
command table and the commands that need no model (``commands.py``: ``HANDLERS``, ``status``,
``cancel``, ``results``), those that load one (``model_commands.py``), ``calibrate`` and
``report`` (``label_commands.py``), ``serve`` (``serve_command.py``: the only module that
imports the HTTP stack), and the command drivers: a plain ``run`` with no job (``run.py``:
inputs -> the drive loop -> an output file), ``embed`` (``embed.py``), easy-vqa accuracy and a
labelled manifest's evaluation (``evaluate.py``), easy-vqa retrieval (``embed_eval.py``),
AWQ/GPTQ calibration on the serving engine (``quantize.py``), and ``bench/`` (``vlmbatch
bench``: the QPM benchmark, its shape scenes and transformers baselines). The package itself imports
nothing.
"""
