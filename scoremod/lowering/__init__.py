"""Routes from the IR to attention: the backends and their registry.

    backend.py   the Backend protocol and the custom_vjp running a fused plan
    registry.py  the ordered registry ``implementation=`` names
    problem.py   the shape of a call and the one axis order
    reference.py the reference path (jax.numpy; runs anywhere)
    segments.py  segment (packed-document) masks read off the IR
    cudnn/       the fused cuDNN path
    cudnn_varlen/ segment masks on cuDNN's variable-length attention
"""
