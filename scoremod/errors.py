"""Errors raised by scoremod. All derive from ScoreModError."""


class ScoreModError(Exception):
    """Base class of every error scoremod raises on purpose.

        >>> import scoremod
        >>> try:
        ...     scoremod.parse("score +")
        ... except scoremod.ScoreModError as e:
        ...     print(type(e).__name__)
        ScoreModSyntaxError
    """


class UnsupportedOpError(ScoreModError):
    """A score_mod uses an operation scoremod cannot represent.

    The message names the JAX primitive (or cuDNN node) and the user's
    ``file:line`` where it was written.

        >>> import jax.numpy as jnp, scoremod
        >>> try:
        ...     scoremod.trace(lambda s, b, h, q, k: jnp.sort(jnp.stack([s, -s]))[0])
        ... except scoremod.UnsupportedOpError as e:
        ...     print(str(e).split(" at ")[0])
        stack
    """


class ScoreModTypeError(ScoreModError, TypeError):
    """A score_mod or its inputs have the wrong shape or dtype.

        >>> import jax.numpy as jnp, scoremod
        >>> try:
        ...     scoremod.trace(lambda s, b, h, q, k: jnp.stack([s, s]))   # not a scalar
        ... except scoremod.ScoreModTypeError as e:
        ...     print(type(e).__name__)
        ScoreModTypeError
    """


class ScoreModValueError(ScoreModError, ValueError):
    """An argument has the right type but a value scoremod cannot use: an
    integer constant outside int32, an empty sequence or head dimension, a
    non-finite ``scale``, an operand name the mod does not have.

        >>> import jax.numpy as jnp, scoremod
        >>> try:
        ...     scoremod.trace(lambda s, b, h, q, k: s + 2 ** 31)
        ... except scoremod.ScoreModValueError as e:
        ...     print("int32" in str(e))
        True
    """


class ScoreModSyntaxError(ScoreModError, SyntaxError):
    """The text form of a score_mod could not be parsed (has line and column).

        >>> import scoremod
        >>> try:
        ...     scoremod.parse("tanh(score")
        ... except scoremod.ScoreModSyntaxError as e:
        ...     print(e.lineno, e.offset)
        1 11
    """

    def __str__(self):  # the message already says where; SyntaxError would append it again
        return self.msg


class CudnnUnavailableError(ScoreModError, NotImplementedError):
    """The fused cuDNN path was requested but cannot run here.

    The message says why (no GPU, float32 inputs, an unsupported op, operand
    gradients) and what to use instead.

        >>> import jax.numpy as jnp, scoremod
        >>> q = jnp.ones((1, 8, 2, 16), jnp.float32)
        >>> try:
        ...     scoremod.attention(q, q, q, implementation="cudnn")
        ... except scoremod.CudnnUnavailableError as e:
        ...     print("implementation=" in str(e))
        True
    """
