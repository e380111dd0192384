"""Leaf utilities shared by the layers above (no vlmbatch imports): whole-or-nothing file
writes (``atomic``) and name -> implementation registries (``registry``).

A package of its own because app/ (exports, quantize), jobs/, labels/ (policies, plots,
reports) and vit_trt/ (ONNX export) all write outputs atomically, and app/ (the command
table), engine/, vit_trt/ and models/ keep registries; a leaf is the one place each of them
may import from.
"""
