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


class TrainingStopped(Exception):
    """A local round stopped early because its stop word was set (a SIGINT or SIGTERM, or a
    role stopping): `steps` updates were done, over `samples` samples, with `mean_loss` the
    mean minibatch loss of those steps. The parameters and momentum passed in hold the state
    after those steps. Not an error of the data or the config: the caller's run is stopping,
    and the round, never finished, is not uploaded or recorded."""

    def __init__(self, steps: int, samples: int = 0, mean_loss: float = 0.0):
        super().__init__(f"local training stopped on request after {steps} steps")
        self.steps = int(steps)
        self.samples = int(samples)
        self.mean_loss = float(mean_loss)


class RunStopped(Exception):
    """A run stopped on request before its last round (a SIGINT or SIGTERM to `edgefl
    simulate`): `round` is the round it was in, which is not recorded; `result` holds what
    the rounds before it left (a RunResult: history, state, model), `summary` what the
    caller wrote of them (None until it has)."""

    def __init__(self, round: int, result=None, rounds_planned: int | None = None):
        done = len(result.history) if result is not None else 0
        super().__init__(f"stopped in round {round}"
                         + (f" of {rounds_planned}" if rounds_planned else "")
                         + f"; {done} round{'s' if done != 1 else ''} done")
        self.round = int(round)
        self.result = result
        self.rounds_planned = rounds_planned
        self.summary: dict | None = None


class ExportError(ValueError):
    """An export that cannot be done; the message names the file, layer or key at fault."""
