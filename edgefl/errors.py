"""Exceptions raised in one layer and caught in others: by both kernel backends and the
layers above them, by configuration readers and every command, by the ONNX export and the
runs that export."""


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


class ExportError(ValueError):
    """An export that cannot be done; the message names the file, layer or key at fault."""
