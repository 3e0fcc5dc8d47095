"""Logging for a service: journald-friendly under systemd, timestamped anywhere else.

Under systemd, stderr goes to the journal, which stamps every line itself and reads a leading
`<N>` as the line's syslog priority (SyslogLevelPrefix=, on by default). So when stderr is the
journal stream we print `<N>logger: message` (no timestamp), and `journalctl -p warning`
filters by level. systemd announces the journal stream in `JOURNAL_STREAM=<dev>:<inode>`;
children inherit the variable even when their stderr goes elsewhere, so the stream's own
device and inode are compared with it (systemd.exec(5) recommends exactly this check).

    setup_logging(config["log.level"])           # the roles, once at start-up
"""
from __future__ import annotations

import logging
import os
import sys

__all__ = ["LEVELS", "JournalFormatter", "parse_level", "setup_logging", "stream_is_journal"]

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR, "critical": logging.CRITICAL}

# syslog priorities (sd-daemon(3): SD_DEBUG 7 ... SD_CRIT 2)
_PRIORITY = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4),
             (logging.INFO, 6), (logging.DEBUG, 7))

PLAIN_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def parse_level(level) -> int:
    """A level name (debug, info, warning, error, critical; any case) or a logging int."""
    if isinstance(level, int) and not isinstance(level, bool):
        return level
    if isinstance(level, str) and level.strip().lower() in LEVELS:
        return LEVELS[level.strip().lower()]
    raise ValueError(f"log level {level!r}: valid levels are {', '.join(LEVELS)}")


def syslog_priority(levelno: int) -> int:
    for threshold, priority in _PRIORITY:
        if levelno >= threshold:
            return priority
    return 7


def stream_is_journal(stream, environ=None) -> bool:
    """True when `stream` is the journal stream systemd connected (JOURNAL_STREAM matches the
    stream's device and inode)."""
    environ = os.environ if environ is None else environ
    value = environ.get("JOURNAL_STREAM", "")
    dev, sep, ino = value.partition(":")
    if not sep:
        return False
    try:
        st = os.fstat(stream.fileno())
        return st.st_dev == int(dev) and st.st_ino == int(ino)
    except (AttributeError, OSError, ValueError):   # no fileno (StringIO), closed, bad value
        return False


class JournalFormatter(logging.Formatter):
    """`<N>logger: message` with N the syslog priority of the level, and no timestamp. Each
    line of a multi-line message (a traceback) gets the prefix, because journald stores every
    line as its own entry."""

    def __init__(self):
        super().__init__("%(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{syslog_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


_HANDLER_MARK = "_edgefl_service_handler"


def setup_logging(level="info", *, stream=None, journal: bool | None = None,
                  logger: logging.Logger | str | None = None) -> logging.Handler:
    """Send `logger` (default: the root logger) to `stream` (default: stderr) at `level`.
    journal: None detects the journal stream (see stream_is_journal); True/False forces the
    journal or the timestamped format. Calling it again replaces the handler it installed
    before, so levels can be changed without duplicating lines."""
    levelno = parse_level(level)
    stream = sys.stderr if stream is None else stream
    if journal is None:
        journal = stream_is_journal(stream)
    target = logger if isinstance(logger, logging.Logger) else logging.getLogger(logger)
    for old in [h for h in target.handlers if getattr(h, _HANDLER_MARK, False)]:
        target.removeHandler(old)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JournalFormatter() if journal else logging.Formatter(PLAIN_FORMAT))
    setattr(handler, _HANDLER_MARK, True)
    target.addHandler(handler)
    target.setLevel(levelno)
    return handler
