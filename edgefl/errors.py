"""Exceptions shared by both kernel backends and the layers above them."""


class ConfigError(ValueError):
    """A configuration the run cannot use; the message names the file and the key.

    Here rather than in edgefl.config (which re-exports it) so that the layers below the
    configs can raise it about files a config names, e.g. DUW's weight file."""


class KernelError(ValueError):
    """An argument a kernel cannot take; the message names the argument and the problem."""


class NonFiniteError(FloatingPointError):
    """Training met a non-finite loss or gradient; `step` is the local step where it stopped.

    The parameters and momentum passed in hold the state before that step's update."""

    def __init__(self, step: int, message: str):
        super().__init__(message)
        self.step = step
