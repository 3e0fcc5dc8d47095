"""One subcommand of `edgefl`: its name, its one-line help, the function that declares its
arguments and the function that runs it (returning the exit status). The command families
(runs, service, ctl) define them; edgefl.cli lists them in the order `edgefl --help` shows."""
from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """A command line the command refuses as given, before doing anything (an --out that
    would replace earlier work): one line, exit status 2, as argparse's own usage errors."""


# ---------------------------------------------------------------------------------------
# argument types: numbers that must be positive are refused while the command line is
# parsed (usage, one line naming the option, exit status 2), before anything is done.
# argparse prefixes the message with "argument --OPTION: ".
# ---------------------------------------------------------------------------------------

def _at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"need a whole number >= {least}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"need a whole number >= {least}, got {value}")
    return value


def count(text: str) -> int:
    """A whole number >= 1: a count of threads, samples, classes (--workers, --limit, --top)."""
    return _at_least(text, 1)


def whole(text: str) -> int:
    """A whole number >= 0: how many to keep (--keep 0 keeps none)."""
    return _at_least(text, 0)


def seconds(text: str) -> float:
    """A finite number of seconds > 0 (--timeout, --wait): a wait of 0 or less would give up
    before any reply could come, and then report it missing."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"need a number of seconds > 0, got {text!r}") \
            from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"need a number of seconds > 0, got {text}")
    return value


def count_or_ids(text: str) -> str:
    """`N|ID,ID,...` (broker accounts --clients): a number is a count, which must be >= 1
    ("-2" is a mistyped count, not a board's id); anything else is a list of ids."""
    stripped = text.strip()
    if re.fullmatch(r"[+-]?\d+", stripped):
        return str(count(stripped))
    return text
