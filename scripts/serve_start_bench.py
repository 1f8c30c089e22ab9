"""Seconds from `python -m launch.serve` starting to its first `/health` 200 (issue 52: ready in
<= 15 s warm, <= 60 s on a fresh cache with the weights converted).

Each start is a new process on a free port, polled every 0.1 s, then stopped with SIGTERM. With
--trees, the starts alternate between checkouts (this one's `.venv` runs each: a worktree of
another commit, to compare side by side on a shared machine); the median of each tree is printed
last, with the load average before and after.

    python scripts/serve_start_bench.py [--repeats=3] [--fresh]
        [--serve_flags="--target_dtype=gguf_q8 --draft_dtype=gguf_q8 --max_batch=8"]
        [--trees=/tmp/old-worktree,.]

--fresh: every start with nothing compiled or measured: a new $SPEC_JAX_CACHE holding only
links to this machine's downloaded and converted weights and built kernels (gguf/, converted/,
kernels/, llama.cpp/ of the current cache), so the compilation cache and gamma=auto's costs
start empty.
"""

import argparse
import os
import pathlib
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
KEPT = ("gguf", "converted", "kernels", "llama.cpp")  # what --fresh keeps of the cache (as links)
TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def fresh_cache(parent: str) -> str:
    """A new cache root under parent with links to the current cache's KEPT folders."""
    source = pathlib.Path(os.environ.get("SPEC_JAX_CACHE", pathlib.Path.home() / ".cache" / "spec_jax"))
    root = pathlib.Path(tempfile.mkdtemp(prefix="cache-", dir=parent))
    for name in KEPT:
        if (source / name).exists():
            (root / name).symlink_to(source / name)
    return str(root)


def start_once(tree: pathlib.Path, serve_flags: list[str], env: dict) -> float:
    """Seconds from the server's process start to its first /health 200; RuntimeError naming
    the tree and the end of its output where it exits first or is not ready in TIMEOUT_S."""
    port = free_port()
    cmd = [sys.executable, "-m", "launch.serve", f"--port={port}", *serve_flags]
    with tempfile.TemporaryFile() as log:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while not healthy(f"http://127.0.0.1:{port}/health"):
                if proc.poll() is not None or time.monotonic() - start > TIMEOUT_S:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-600:]
                    raise RuntimeError(f"{tree}: the server did not become ready: {tail}")
                time.sleep(0.1)
            return time.monotonic() - start
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="starts per tree (>= 1)")
    parser.add_argument("--fresh", action="store_true", help="nothing compiled or measured at each start")
    parser.add_argument(
        "--serve_flags",
        default="--target_dtype=gguf_q8 --draft_dtype=gguf_q8 --max_batch=8",
        help="launch.serve's flags, space-separated",
    )
    parser.add_argument("--trees", default=".", help="checkouts to start from, comma-separated, alternating")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats: at least 1, got {args.repeats}")
    trees = [pathlib.Path(t).resolve() for t in args.trees.split(",")]
    missing = [str(t) for t in trees if not (t / "launch" / "serve.py").is_file()]
    if missing:
        parser.error(f"--trees: not a checkout of this project (no launch/serve.py): {', '.join(missing)}")
    print(f"load average before: {os.getloadavg()}", flush=True)
    seconds = {t: [] for t in trees}
    scratch = tempfile.mkdtemp(prefix="spec-jax-start-")
    try:
        for i in range(args.repeats):
            for tree in trees:
                env = dict(os.environ, PYTHONPATH=str(tree))
                if args.fresh:
                    env["SPEC_JAX_CACHE"] = fresh_cache(scratch)
                seconds[tree].append(start_once(tree, args.serve_flags.split(), env))
                print(f"{tree} start {i + 1}: ready in {seconds[tree][-1]:.1f} s", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"load average after: {os.getloadavg()}")
    for tree, values in seconds.items():
        print(f"{tree}: median {statistics.median(values):.1f} s to ready over {len(values)} starts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
