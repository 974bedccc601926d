"""Progress for long work, on stderr, only when a person is watching (a TTY) and the work is big."""

from __future__ import annotations

import sys
import time


class Progress:
    """`with Progress("initialising", total) as p: p.advance(n)` prints `label 42%` in place."""

    def __init__(self, label: str, total: float, *, min_total: float = 0.0, stream=None):
        self.label, self.total, self.done = label, max(float(total), 1.0), 0.0
        self.stream = stream or sys.stderr
        self.enabled = total >= min_total and getattr(self.stream, "isatty", lambda: False)()
        self._last = 0.0
        self._start = time.monotonic()

    def advance(self, amount: float) -> None:
        self.done += amount
        now = time.monotonic()
        if self.enabled and now - self._last > 0.2:
            self._last = now
            self.stream.write(f"\r{self.label} {100 * self.done / self.total:5.1f}%")
            self.stream.flush()

    def close(self) -> None:
        """The end of work not run inside `with` (printed once)."""
        if not getattr(self, "_closed", False):
            self._closed = True
            self.__exit__(None)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, *rest) -> None:
        if self.enabled:  # on failure just end the line, so the error message starts on its own
            done = "" if exc_type else f"\r{self.label} done in {time.monotonic() - self._start:.1f}s"
            self.stream.write(done + "\n")
            self.stream.flush()
