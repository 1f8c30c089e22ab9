"""Prompt lookup's per-row draft lengths (issue 53 item 5) before/after, on the workload prompts'
code-editing and quoting categories: plain decoding, prompt lookup as it was (gamma drafts at
every match, gamma=auto up to 8, every round verified gamma + 1 wide: match_factor=inf,
auto_gamma_max 8, "ends" widths), as it is (drafts from the match length in powers of two,
gamma=auto up to 16, "doubling" widths) and as it is with "ends" widths; each greedy,
gamma=auto, interleaved per prompt in one process (one model load, the same load on the
machine for every system).

  python scripts/lookup_lengths_bench.py --prompt_set=bench --per_category=4 --max_new_tokens=64

Prints one line per system: tokens/s over decode seconds (gamma=auto's chunks, compilation
excluded), mean accepted length, drafts per round, identity with plain decoding.
"""

import argparse
import dataclasses
import math
import os
import sys
from typing import ClassVar

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import bench_workloads, common  # noqa: E402
from spec_jax import generate  # noqa: E402
from spec_jax.drafting import AUTO_GAMMA_MAX, lookup  # noqa: E402

CATEGORIES = ("code_editing", "quoting_qa")


@dataclasses.dataclass(frozen=True)
class LookupBefore(lookup.PromptLookupDrafter):
    """Prompt lookup before per-row lengths: gamma drafts at every match, gamma=auto up to 8,
    every round verified gamma + 1 wide."""

    auto_gamma_max: ClassVar[int] = AUTO_GAMMA_MAX
    auto_widths: ClassVar[str] = "ends"


def systems_for(vocab: int) -> dict:
    """{name: (draft, verify_widths)} of the systems compared."""
    after = (lookup.PromptLookupDrafter(vocab, 3), ())
    before = (LookupBefore(vocab, 3, match_factor=math.inf), ())
    return {
        "plain": (None, "auto"),
        "before (gamma at every match, auto <= 8, ends)": (before, "auto"),
        "after (match lengths, auto <= 16, doubling)": (after, "auto"),
        "after with ends widths": (after, "ends"),
    }


def run_prompt(target, systems: dict, prompt, i: int, max_new_tokens: int) -> dict:
    """{name: Generation} of every system on one prompt, the first system rotating with i."""
    names = list(systems)
    outputs = {}
    for name in names[i % len(names) :] + names[: i % len(names)]:
        draft, widths = systems[name]
        outputs[name] = generate(
            target,
            [prompt],
            draft=draft,
            verify_widths=widths,
            gamma="auto",
            max_new_tokens=max_new_tokens,
            temperature=0.0,
            eos_id=None,
        )
    return outputs


def add(totals: dict, outputs: dict) -> None:
    """Adds one prompt's outputs to each system's totals."""
    for name, gen in outputs.items():
        s, t = (
            gen.stats,
            totals.setdefault(
                name,
                dict.fromkeys(("tokens", "seconds", "rounds", "drafted", "accepted", "same", "prompts"), 0),
            ),
        )
        t["tokens"] += len(gen.tokens[0]) - 1
        t["seconds"] += s["decode_seconds"]
        t["rounds"] += s.get("num_rounds", 0)
        t["drafted"] += s.get("num_draft_tokens", 0)
        t["accepted"] += s.get("num_accepted_tokens", 0)
        t["same"] += gen.tokens == outputs["plain"].tokens
        t["prompts"] += 1


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt_set", default="bench", choices=bench_workloads.PROMPT_SETS)
    parser.add_argument("--per_category", type=int, default=4)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="gguf_q8")
    args = parser.parse_args()
    target = common.load_model(args.target, args.dtype)
    systems = systems_for(target.config.vocab_size)
    records = bench_workloads.load_prompts(args.prompt_set, CATEGORIES, args.per_category)
    totals = {}
    for i, record in enumerate(records):
        prompt = target.tokenizer.encode(record["prompt"])
        outputs = run_prompt(target, systems, prompt, i, args.max_new_tokens)
        add(totals, outputs)
        line = "; ".join(
            f"{n.split(' (')[0]} {g.stats['decode_seconds']:.2f}s {g.stats.get('gamma_schedule')}"
            for n, g in outputs.items()
        )
        print(
            f"prompt {i + 1}/{len(records)} ({record['category']}, {len(prompt)} tokens): {line}", flush=True
        )
    print(f"load average: {os.getloadavg()}")
    for n, t in totals.items():
        rounds = max(t["rounds"], 1)
        print(
            f"{n}: {t['tokens'] / t['seconds']:.2f} tok/s, decode {t['seconds']:.1f} s, "
            f"accepted/round {t['accepted'] / rounds:.2f}, drafts/round {t['drafted'] / rounds:.2f}, "
            f"acceptance {t['accepted'] / max(t['drafted'], 1):.2f}, identical {t['same']}/{t['prompts']}"
        )


if __name__ == "__main__":
    main()
