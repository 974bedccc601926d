"""The one error type users see: a one-line message that says what to fix."""


class DiffExportError(Exception):
    """A user-facing failure. The CLI prints `error: <message>` and exits with code 2."""

    exit_code = 2
