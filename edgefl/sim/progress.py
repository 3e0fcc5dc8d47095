"""A run's progress on stderr: a redrawn bar on a terminal, one line per round otherwise.
The lines before the first round and after the last (data, export, plot) are
edgefl.runs.phases'."""
from __future__ import annotations

import math

__all__ = ["Progress"]


class Progress:
    """Round, accuracy and ETA on a stream: a redrawn bar when it is a TTY, one line per
    round otherwise; nothing when disabled (--quiet)."""

    WIDTH = 24

    def __init__(self, total: int, stream, enabled: bool = True):
        self.total, self.stream, self.enabled = total, stream, enabled
        self.tty = enabled and hasattr(stream, "isatty") and stream.isatty()
        self.last_accuracy = None
        self.drawn = False

    def update(self, record: dict) -> None:
        if not self.enabled:
            return
        r, elapsed = record["round"], record["elapsed_s"]
        if record["test_accuracy"] is not None:
            self.last_accuracy = record["test_accuracy"]
        eta = elapsed / r * (self.total - r)
        acc = "  -   " if self.last_accuracy is None else f"{self.last_accuracy:.4f}"
        loss = record["train_loss"]
        loss = "nan" if loss is None or not math.isfinite(loss) else f"{loss:.4f}"
        if self.tty:
            filled = self.WIDTH * r // self.total
            bar = "#" * filled + "-" * (self.WIDTH - filled)
            self.stream.write(f"\rround {r:>{len(str(self.total))}}/{self.total} [{bar}] "
                              f"acc {acc}  train loss {loss}  ETA {_duration(eta)} ")
            self.drawn = True
        else:
            self.stream.write(f"round {r}/{self.total} acc {acc} train_loss {loss} "
                              f"{record['wall_s']:.3f}s ETA {_duration(eta)}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    m, s = divmod(seconds, 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"
