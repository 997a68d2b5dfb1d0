"""Lowerings of the IR: the jax.numpy reference path and the fused cuDNN path."""
