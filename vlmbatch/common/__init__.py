"""Leaf utilities shared by the layers above (no vlmbatch imports): whole-or-nothing file
writes (``atomic``), name -> implementation registries (``registry``), the declaration of
command-line options on config fields (``options``: the configs of engine/, pipeline/, jobs/,
server/ and cli/ declare theirs; cli/ derives the parsers), and how every child interpreter is
started (``children``: decoder and engine processes, Ray's workers) so that it imports this
``vlmbatch`` whatever the working directory.

A package of its own because cli/ (quantize), outputs/, jobs/, labels/ (policies, plots,
reports) and vit_trt/ (ONNX export) all write outputs atomically, cli/ (the command table),
engine/, vit_trt/ and models/ keep registries, and preprocessing/, serving/ and jobs/ start
child interpreters; a leaf is the one place each of them may import from.
"""
