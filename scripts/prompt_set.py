"""Writes a prompt set of experiments.common as JSON Lines ({"prompt": ...} per line), for
`launch.generate --prompts_file` and the peers: `python scripts/prompt_set.py heldout
experiments/prompts/heldout.jsonl` wrote the committed held-out set."""

import json
import sys

from experiments import common

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in common.PROMPT_SETS:
        sys.exit(f"usage: python scripts/prompt_set.py {{{'|'.join(common.PROMPT_SETS)}}} OUT.jsonl")
    name, out = sys.argv[1:]
    count = len(common.BENCH_PROMPTS) if name == "open" else 8
    with open(out, "w") as f:
        for prompt in common.prompt_set(name, count):
            f.write(json.dumps({"prompt": prompt}) + "\n")
