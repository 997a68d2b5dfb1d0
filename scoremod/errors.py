"""Errors raised by scoremod. All derive from ScoreModError."""


class ScoreModError(Exception):
    """Base class of every error scoremod raises on purpose."""


class UnsupportedOpError(ScoreModError):
    """A score_mod uses an operation scoremod cannot represent.

    The message names the JAX primitive (or cuDNN node) and the user's
    ``file:line`` where it was written.
    """


class ScoreModTypeError(ScoreModError, TypeError):
    """A score_mod or its inputs have the wrong shape or dtype."""


class ScoreModSyntaxError(ScoreModError, SyntaxError):
    """The text form of a score_mod could not be parsed (has line and column)."""


class CudnnUnavailableError(ScoreModError, NotImplementedError):
    """The fused cuDNN path was requested but cannot run here."""
