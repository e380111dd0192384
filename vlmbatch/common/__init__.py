"""Leaf utilities shared by the layers above (no vlmbatch imports): whole-or-nothing file
writes (``atomic``) and name -> implementation registries (``registry``).

A package of its own because jobs/ (results), pipeline/ (quantize) and vit_trt/ (ONNX
export) all write outputs atomically, and pipeline/, vit_trt/ and models/ all keep
registries; a leaf is the one place each of them may import from.
"""
