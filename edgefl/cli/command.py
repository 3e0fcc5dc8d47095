"""One subcommand of `edgefl`: its name, its one-line help, the function that declares its
arguments and the function that runs it (returning the exit status). The command families
(runs, service, ctl) define them; edgefl.cli lists them in the order `edgefl --help` shows."""
from __future__ import annotations

import argparse
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
