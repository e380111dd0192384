"""Leaf utilities shared by the layers above (no vlmbatch imports): whole-or-nothing file
writes (``atomic``), name -> implementation registries (``registry``) and the declaration of
command-line options on config fields (``options``: the configs of engine/, pipeline/, jobs/
and app/ declare theirs; app/ derives the parsers).

A package of its own because app/ (exports, quantize), jobs/, labels/ (policies, plots,
reports) and vit_trt/ (ONNX export) all write outputs atomically, and app/ (the command
table), engine/, vit_trt/ and models/ keep registries; a leaf is the one place each of them
may import from.
"""
