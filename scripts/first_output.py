"""Seconds from a `launch.generate --stream` start to its first generated text (issue 39's goal:
a second run with a prompt of a new length prints its first token within 10 s).

Runs the command once per prompt, each prompt of a length no earlier run had, from the bench
prompts and from the held-out set (experiments.common), with whatever caches the machine has: run
the default pair once first (`make demo`) so that this measures the second run. Writes a markdown
table (median and range per prompt set) to --out and prints it:

  python scripts/first_output.py --out=experiments/results/first_output/first_output.md
  python scripts/first_output.py --args="--target=random --draft=random-draft" --prompts=2
"""

import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import time

from absl import app, flags

from experiments import common

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Markdown file to write the table to (default: print only).")
flags.DEFINE_string("args", "", "More launch.generate flags (default: the default pair).")
flags.DEFINE_integer("prompts", 4, "Prompts per set (bench, held-out).", lower_bound=1, upper_bound=8)
flags.DEFINE_integer(
    "max_new_tokens",
    None,
    "Tokens each run generates (default: launch.generate's own, as after make demo).",
    lower_bound=1,
    upper_bound=4096,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
HEADER = "--- prompt:"


def first_output(prompt: str, extra: list[str], max_new_tokens: int | None) -> tuple[float, float]:
    """(seconds to the first byte of generated text, seconds to the process's end)."""
    cmd = [sys.executable, "-m", "launch.generate", "--stream", f"--prompt={prompt}"]
    cmd += ([] if max_new_tokens is None else [f"--max_new_tokens={max_new_tokens}"]) + extra
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    first, line = None, b""
    while (byte := proc.stdout.read(1)) != b"":
        if first is None and line.startswith(HEADER.encode()) and line.endswith(b"\n"):
            first = time.perf_counter() - start  # the byte after the prompt's header line
        line = b"" if line.endswith(b"\n") else line
        line += byte
    if proc.wait() != 0 or first is None:
        raise RuntimeError(f"{shlex.join(cmd)} exited {proc.returncode} without generated text")
    return first, time.perf_counter() - start


def new_lengths(prompts: list[str], seen: set[int]) -> list[str]:
    """Each prompt made a character longer until no earlier prompt had its length (a length in
    characters: a new token count is likely, not certain)."""
    out = []
    for p in prompts:
        while len(p) in seen:
            p += " "
        seen.add(len(p))
        out.append(p)
    return out


def main(argv):
    del argv
    extra = shlex.split(FLAGS.args)
    seen: set[int] = set()
    rows = []
    for name, prompts in (
        ("bench", list(common.BENCH_PROMPTS[: FLAGS.prompts])),
        ("held-out", common.heldout_prompts(FLAGS.prompts)),
    ):
        times = [first_output(p, extra, FLAGS.max_new_tokens) for p in new_lengths(prompts, seen)]
        firsts, walls = [t[0] for t in times], [t[1] for t in times]
        rows.append(
            f"| {name} | {len(times)} | {statistics.median(firsts):.1f} ({min(firsts):.1f}-{max(firsts):.1f})"
            f" | {statistics.median(walls):.1f} ({min(walls):.1f}-{max(walls):.1f}) |"
        )
    table = "\n".join(
        [
            f"`python scripts/first_output.py --args={shlex.quote(FLAGS.args)} --prompts={FLAGS.prompts}"
            + (f" --max_new_tokens={FLAGS.max_new_tokens}`" if FLAGS.max_new_tokens else "`")
            + f" ({FLAGS.max_new_tokens or 'the default'} new tokens, each prompt a new length)",
            "",
            "| prompts | runs | first text (s): median (range) | whole run (s): median (range) |",
            "|---|---|---|---|",
            *rows,
        ]
    )
    print(table)
    if FLAGS.out:
        path = pathlib.Path(FLAGS.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(table + "\n")


if __name__ == "__main__":
    app.run(main)
