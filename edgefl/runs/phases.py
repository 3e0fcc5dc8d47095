"""One line on stderr for each slow phase of a run outside its rounds -- loading the data
set, exporting ONNX, drawing curves.png -- so a run is never silent for seconds before its
first round or after its last (a Fashion-MNIST run spends seconds in each). The round-by-
round progress is edgefl.sim.progress's; these are the lines around it:

    data: fashion-mnist, 60000 train / 10000 test samples, 10 clients (0.71 s)
    export: model.onnx, 441,312 bytes (0.09 s)
    plot: curves.png (0.55 s)

The line's start is written (and flushed) before the phase runs, its end after, so a phase
that hangs or is slow shows what it is doing. With no stream, nothing is written.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

__all__ = ["phase"]


@contextmanager
def phase(stream, label: str):
    """Write `label: ` before the block and the block's `note` (a list it may append
    words to) and its duration after: `with phase(stream, "data") as note: ...;
    note.append("digits, 1438 train / 359 test samples")`. A block that raises ends the
    line with "failed" and the exception goes on."""
    note: list = []
    if stream is None:
        yield note
        return
    start = time.perf_counter()
    stream.write(f"{label}: ")
    stream.flush()
    try:
        yield note
    except BaseException:
        stream.write("failed\n")
        stream.flush()
        raise
    what = ", ".join(str(n) for n in note)
    stream.write(f"{what}{' ' if what else ''}({time.perf_counter() - start:.2f} s)\n")
    stream.flush()
