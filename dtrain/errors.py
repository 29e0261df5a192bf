"""User-facing errors: one clear message each, never a bare traceback."""

# What a user is told of JSON or YAML nested deeper than Python's recursion limit (RecursionError)
TOO_DEEP = "nested too deep for Python's recursion limit"


class UserError(Exception):
    """A problem with the user's input (config, data, model path, environment).

    The CLI prints ``str(err)`` on one line and exits with status 2.
    """


class ConfigError(UserError):
    """An unknown key, a wrong type or an invalid value in a config or override."""


class DataError(UserError):
    """An unreadable data file, or bad rows with ``on_bad_row: error``."""


class ModelError(UserError):
    """A model path that cannot be loaded, or a missing download."""


class BadRow(Exception):
    """Raised inside row parsing; caught and recorded with the row's source."""
