"""The one exception type for bad user input (recipes, tool files, interaction files, models).

Its message is a single line that names the file, the key or the value at fault; the CLI prints
it without a traceback and exits with status 2, before any work starts.
"""


class ConfigError(Exception):
    """A user-facing configuration problem, reported as one line."""


class RunFailed(Exception):
    """A run that started could not go on (too many failed episodes, a dead worker). Its message is
    one line with the cause; the CLI prints it and exits with status 1."""
