"""What launch.generate prints and writes about a run: its summary line (summary_line), the
warning naming prompts whose logits became non-finite (report_nonfinite), and --output_json's
settings (settings_report)."""

from spec_jax import metrics


def summary_line(label: str, s: dict) -> str:
    """One line of a run's stats: tokens, speed, timings, acceptance, sources, gamma=auto chunks."""
    line = (
        f"{label}: {s['num_new_tokens']} tokens, {s['tokens_per_second']:.2f} tokens/s "
        f"(compile {s['compile_seconds']:.1f} s, prefill {s['prefill_seconds']:.3f} s, "
        f"decode {s['decode_seconds']:.3f} s)"
    )
    if s.get("num_draft_tokens"):
        line += (
            f", acceptance rate {s['acceptance_rate']:.3f}, mean accepted length "
            f"{s['mean_accepted_length']:.2f}, alpha_hat {s['alpha_hat']:.3f}"
        )
    if "fraction_of_rounds_by_drafter" in s and len(s["fraction_of_rounds_by_drafter"]) > 1:
        line += ", rounds served / acceptance rate: " + ", ".join(
            f"{name} {share:.2f} / {s['acceptance_rate_by_drafter'][name]:.3f}"
            for name, share in s["fraction_of_rounds_by_drafter"].items()
        )
    if "gamma_schedules" in s:
        chunks = [
            f"{g}x{r}" if r < 2**31 - 1 else f"{g} to the end" for b in s["gamma_schedules"] for g, r in b
        ]
        line += f", gamma=auto chunks (gamma x rounds): {' '.join(chunks)}"
    return line


def report_nonfinite(stats, prompts) -> str | None:
    """The one-line warning naming the prompts whose target logits became NaN or infinite (each
    stopped there: its output is cut short), or None when there are none."""
    rows = metrics.nonfinite_rows(stats)
    if not rows:
        return None
    shown = ", ".join(f"{i} ({prompts[i][:30]!r})" for i in rows[:5]) + (", ..." if len(rows) > 5 else "")
    return (
        f"warning: the target's logits became NaN or infinite for {len(rows)} of {len(prompts)} "
        f"prompts (by index from 0: {shown}); each stopped there and its output is cut short "
        f"(check the --target weights and --target_dtype)"
    )
