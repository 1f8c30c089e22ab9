"""A command line for tests/test_cli_driver.py: checks that tests/cli_driver.py reports what a
real process would (a traceback, writes straight to the file descriptors, flags reset)."""

import os
import sys

from absl import flags

from launch import common

flags.DEFINE_string("mode", "ok", "What to do.")
flags.DEFINE_integer("count", 0, "A flag whose value must not leak into the next case.")
WORD = "plain"  # what --mode=word prints: a case's prelude may patch it (tests/cli_driver.py)


def main(argv):
    del argv
    mode = flags.FLAGS.mode
    if mode == "crash":
        raise RuntimeError("boom")
    if mode == "fd":
        os.write(2, b"written to fd 2\n")
        return 0
    if mode == "count":
        print(f"count={flags.FLAGS.count}")
        return 0
    if mode == "bad":
        raise common.UsageError("--mode: bad")
    if mode == "word":
        print(WORD)
        return 0
    print("ok", file=sys.stdout)
    return 0


def cli():
    common.run(main, compilation_cache=False)
