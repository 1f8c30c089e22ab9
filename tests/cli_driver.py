"""Runs one entry point's command line on many argument lists in one Python process, for the
tests of the command lines (tests/conftest.py `cli_case`): each list is `python -m MODULE ARGS` as
the module's cli() sees it, with absl's flags back at their defaults between lists, the file
descriptors 1 and 2 captured (so absl's and C++ logging count too) and the exit code taken from
SystemExit. Starting Python and importing jax once instead of once per case is the point: the
refusals themselves take milliseconds, and runs that decode share the process's compiled programs.

A case is a list of arguments, or {"args": [...], "prelude": SOURCE, "extra": {...}}: SOURCE is
run first (with `extra` and `patch(owner, name, value)` in its namespace: a script's patch of an
entry point), and every attribute it patched is put back after the case.

Usage: python tests/cli_driver.py MODULE CASES_JSON RESULTS_JSON
"""

import importlib
import json
import os
import sys
import tempfile
import traceback


def run_case(module, case):
    """The case's {"returncode", "stdout", "stderr"}, its prelude's patches undone after it."""
    if isinstance(case, list):
        case = {"args": case}
    undo = []

    def patch(owner, name, value):
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    try:
        if case.get("prelude"):
            exec(case["prelude"], {"patch": patch, "extra": case.get("extra", {})})
        return run_args(module, case["args"])
    finally:
        for owner, name, value in reversed(undo):
            setattr(owner, name, value)


def run_args(module, args):
    from absl import flags

    flags.FLAGS.unparse_flags()
    sys.argv = [module.__file__, *args]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            module.cli()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # what a real process would print before dying
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        out.seek(0)
        err.seek(0)
        return {
            "returncode": code,
            "stdout": out.read().decode(errors="replace"),
            "stderr": err.read().decode(errors="replace"),
        }


def main():
    module_name, cases_path, results_path = sys.argv[1:4]
    with open(cases_path) as f:
        cases = json.load(f)
    module = importlib.import_module(module_name)
    results = [run_case(module, case) for case in cases]
    with open(results_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
