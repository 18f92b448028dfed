"""Progress of long work (`ox.fit`, `ox.max_batch`): by default a status line on stderr
when stderr is a terminal, rewritten in place; nothing under pytest or CI, or when the
output goes to a file."""

import contextlib
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from typing import Any

Progress = Callable[[str], Any]


class StatusLine:
    """One line of a terminal, rewritten by each call; `close` ends it."""

    def __init__(self, stream: Any):  # anything with `write` and `flush`
        self.stream = stream
        self.width = 0

    def __call__(self, line: str) -> None:
        text = line[: max(20, shutil.get_terminal_size().columns - 1)]
        self.stream.write("\r" + text + " " * max(0, self.width - len(text)))
        self.stream.flush()
        self.width = len(text)

    def close(self) -> None:
        if self.width:
            self.stream.write("\n")
            self.stream.flush()


def _silent(line: str) -> None:
    del line


def shows_status(stream: Any) -> bool:
    """Whether a default status line is shown on `stream`: a terminal, outside pytest and
    CI (`CI` set in the environment, as CI services set it)."""
    if os.environ.get("CI") or "PYTEST_CURRENT_TEST" in os.environ:
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())


_NOT_PROGRESS = (
    "{where}(progress={value!r}): expected a function taking one line (`print`), True (a "
    "status line on stderr), False (nothing), or None (the default: a status line when "
    "stderr is a terminal, outside pytest and CI)."
)


@contextlib.contextmanager
def reporting(where: str, progress: Any) -> Iterator[Progress]:
    """What to call with each line: `progress` itself when it is a function; nothing for
    `False`; a status line on stderr for `True`, and for `None` where `shows_status`
    says so. Raises `TypeError` for anything else, before any work."""
    if progress is not None and not isinstance(progress, bool) and not callable(progress):
        raise TypeError(_NOT_PROGRESS.format(where=where, value=progress))
    if callable(progress):
        yield progress
    elif progress is False or (progress is None and not shows_status(sys.stderr)):
        yield _silent
    else:
        status = StatusLine(sys.stderr)
        try:
            yield status
        finally:
            status.close()
