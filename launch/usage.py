"""What a command tells its user, below launch.common and launch.runtime (both import it; it
imports neither, nor jax): bad input (UsageError, one line with exit code 2), an interruption
(Interrupted, raise_if_interrupted), the files this process wrote (WRITTEN, named by the
interrupt line), and the --output_json checks (check_output_json, finite_json)."""

import math
import os
import signal

COMPILATION_CACHE_ENV = "SPEC_JAX_COMPILATION_CACHE"


class UsageError(ValueError):
    """Bad input from the command line; reported as one line with exit code 2."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived (raised by the handler launch.common.run installs; a
    BaseException, like KeyboardInterrupt, so that no `except Exception` swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# The signals whose handler ran: where its exception was swallowed in a place the handler cannot
# name (a weakref callback), raise_if_interrupted still ends the run.
RECEIVED: list[int] = []

# The files this process wrote for the user (launch.runtime.write_json_atomic), named by the interrupt line.
WRITTEN: list[str] = []


def raise_if_interrupted() -> None:
    """Interrupted for a signal that arrived earlier (normally raised where it arrived; this
    catches one whose exception was swallowed): called before an output file is written and
    when main returns."""
    if RECEIVED:
        raise Interrupted(RECEIVED[0])


def finite_json(value):
    """value with every non-finite float (NaN, inf) replaced by None, recursively: strict JSON
    parsers reject the bare NaN that json.dump writes (e.g. acceptance_rate with --draft=none)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def check_output_json(path: str) -> None:
    """UsageError unless --output_json names a file in an existing folder (checked before any
    model is loaded, and again when writing)."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        raise UsageError(f"--output_json: {path} is a folder; name a file")
    if not os.path.isdir(os.path.dirname(path)):
        raise UsageError(f"--output_json: directory {os.path.dirname(path)} does not exist")
