"""Exceptions raised in one layer and caught in others: by both kernel backends and the
layers above them, by configuration readers and every command, by the ONNX export and the
runs that export; and the one shape of "why a run ended early" (`stop_record`)."""


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

    @property
    def record(self) -> dict:
        """summary.json's `stopped` for this stop (stop_record, reason "stop_requested")."""
        done = len(self.result.history) if self.result is not None else 0
        return stop_record("stop_requested", self.round, done, self.rounds_planned, str(self))


STOP_REASONS = ("privacy_budget", "stop_requested")


def stop_record(reason: str, in_round: int, rounds_done: int, rounds_planned: int | None,
                message: str) -> dict:
    """Why a run ended before its last round, in one shape whatever the reason: summary.json's
    `stopped` (and `privacy.stopped`) and the run_finished event's. `reason`: "privacy_budget"
    (the next round would pass the DP target: the run ends finished, every output written) or
    "stop_requested" (SIGINT/SIGTERM, or the caller's stop flag: the rounds done are written);
    `in_round`: the round it ended in, which is not recorded; `rounds_done`, `rounds_planned`;
    `message`: the same in words."""
    if reason not in STOP_REASONS:
        raise ValueError(f"stop reason {reason!r}; valid: {', '.join(STOP_REASONS)}")
    return {"reason": reason, "in_round": int(in_round), "rounds_done": int(rounds_done),
            "rounds_planned": rounds_planned, "message": message}


def budget_stop(exc: Exception, round: int, rounds_planned: int | None) -> dict:
    """The stop record of a run whose DP budget (privacy.BudgetExhausted `exc`) ends it
    before `round`: rounds 1 to round - 1 are done."""
    return stop_record("privacy_budget", round, round - 1, rounds_planned,
                       f"round {round}: {exc}")


class CheckpointError(ValueError):
    """A model.npz (or a run directory meant to hold one) that is missing, unreadable or
    inconsistent; the message names the file. Raised by edgefl.checkpoint.read_model, which
    `edgefl export` and a run's `model.init` both read a checkpoint with."""


class ExportError(ValueError):
    """An export that cannot be done; the message names the file, layer or key at fault."""
