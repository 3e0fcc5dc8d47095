"""Exceptions shared by both kernel backends and the layers above them."""


class KernelError(ValueError):
    """An argument a kernel cannot take; the message names the argument and the problem."""


class NonFiniteError(FloatingPointError):
    """Training met a non-finite loss or gradient; `step` is the local step where it stopped.

    The parameters and momentum passed in hold the state before that step's update."""

    def __init__(self, step: int, message: str):
        super().__init__(message)
        self.step = step
