"""Module-level lambdas and functions for the key tests (the TE cache bug)."""

import jax.numpy as jnp

softcap_lambda = lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0)  # noqa: E731
relbias_lambda = lambda s, b, h, q, k: s + 0.1 * (k - q)  # noqa: E731
default_30 = lambda s, b, h, q, k, cap=30.0: cap * jnp.tanh(s / cap)  # noqa: E731
default_50 = lambda s, b, h, q, k, cap=50.0: cap * jnp.tanh(s / cap)  # noqa: E731


def softcap_named(score, b, h, q_idx, kv_idx):
    return 30.0 * jnp.tanh(score / 30.0)


def make_softcap(cap):
    return lambda s, b, h, q, k: cap * jnp.tanh(s / cap)
