"""Routes from the IR to attention: the backends and their registry.

    backend.py   the Backend protocol and the custom_jvp running a fused plan
    registry.py  the ordered registry ``implementation=`` names
    problem.py   the shape of a call and the one axis order
    reference.py the reference path (jax.numpy; runs anywhere)
    segments.py  segment (packed-document) masks read off the IR
    patterns.py  IR patterns the backends share (mask conditions, relative positions)
    intervals.py interval analysis: bounds of a mod's nodes over sets of inputs
    block_maps.py the tiles a block-sparse kernel visits, read off the IR
    sharding.py  a fused backend's calls on sharded arrays and under vmap
    nonfinite.py the masked-key rule for non-finite V around every fused kernel call
    cudnn/       the fused cuDNN path
    cudnn_varlen/ segment masks on cuDNN's variable-length attention
"""
