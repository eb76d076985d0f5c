"""The one exception type for bad user input (recipes, tool files, interaction files, models).

Its message is a single line that names the file, the key or the value at fault; the CLI prints
it without a traceback and exits with status 2, before any work starts.
"""


class ConfigError(Exception):
    """A user-facing configuration problem, reported as one line."""


class RunFailed(Exception):
    """A run that started could not go on (too many failed episodes, a dead worker). Its message is
    one line with the cause; the CLI prints it and exits with status 1."""


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a supervisor, `timeout`, a closed terminal), raised where Ctrl-C's
    KeyboardInterrupt would be, so the same clean-up runs: finished episodes are kept and a launched
    SGLang server is stopped. A KeyboardInterrupt, so no plug-in's `sys.exit()` handling takes it
    for one call's failure."""

    # The latest one raised in this process. Ray's ray.get and ray.wait check for signals while they
    # block and turn whatever the handler raised into a plain KeyboardInterrupt: a SIGTERM that
    # landed there was reported as a Ctrl-C (status 130). The CLI finds the signal here.
    latest: "Terminated | None" = None

    def __init__(self, signum: int, cause: str = ""):
        super().__init__(signum)
        self.signum = signum
        self.cause = cause  # said after the signal's name, when the signal has a known sender
        Terminated.latest = self

    @staticmethod
    def behind(interrupt: KeyboardInterrupt) -> "Terminated | None":
        """The Terminated that `interrupt` is or stands for: a library may have replaced it."""
        return interrupt if isinstance(interrupt, Terminated) else Terminated.latest
