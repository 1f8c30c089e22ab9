"""Generate text with speculative decoding (or plain decoding with --draft=none).

Examples:
  python -m launch.generate --target=random --draft=random-draft --prompt="def f(x):"
  python -m launch.generate --prompts_file=prompts.jsonl --temperature=0 --compare_autoregressive
  python -m launch.generate --chat --prompt="Reverse a string in Python."  # the target's chat template
  python -m launch.generate --stream --prompts_file=prompts.jsonl --batch_size=4  # text as it comes (spec_jax.engine)
  python -m launch.generate --drafter=hybrid --max_ngram=3 --draft_threshold=0.3 ...  # lookup, then the model
  python -m launch.generate --drafter=suffix --draft_threshold=0.4 ...   # no model: text seen before
  python -m launch.generate --mesh=data:2,model:4 ...             # tensor + data parallel
  python -m launch.generate --mesh=auto --distributed ...           # every host of a Cloud TPU pod
  python -m launch.generate --mesh=data:2,model:4 --coordinator_address=10.0.0.2:8476 \
      --num_processes=2 --process_id=0 ...                          # one process per host

Multi-host: every process runs the same command (only --process_id differs, or nothing on a
Cloud TPU VM, where jax.distributed.initialize() finds its peers); only process 0 prints and
writes --output_json.

Compiled programs are kept in $SPEC_JAX_CACHE/compilation/ and loaded by later runs instead of
compiled again; --nocompilation_cache (see --helpfull) or SPEC_JAX_COMPILATION_CACHE=0 turns
that off.

Bad flags and bad input exit with code 2 and one line on stderr; the flags (model names, the
warp, --gamma against the context, the prompts file, --output_json) are checked before any model
is loaded or downloaded, --gamma's bound once the target's context is known. A prompt whose target
logits become NaN or infinite stops there: one warning line on stderr names it, and its entry in
--output_json says "nonfinite_logits": true (the other prompts' outputs are unaffected).
"""

import builtins
import dataclasses
import functools
import sys
import time

import jax
from absl import flags

import models
import spec_jax
from launch import common, distributed, report, runtime
from launch import flags as shared
from launch import prompts as prompt_flags
from launch.prompts import DEFAULT_PROMPT, Prompt, encode_prompts, read_prompts
from spec_jax import engine as engine_lib
from spec_jax import metrics
from spec_jax.bounds import validate
from spec_jax.request import Request
from spec_jax.rows import stream_context

FLAGS = flags.FLAGS
for _module in (shared, prompt_flags, distributed):  # --help lists them with generate's own
    flags.adopt_module_key_flags(_module)

flags.DEFINE_integer("batch_size", 1, "Prompts decoded together in one batch.", lower_bound=1)
flags.DEFINE_bool(
    "compare_autoregressive",
    False,
    "Also run plain decoding of the target; report the speedup and whether outputs match (both "
    "modes are run once on the first batch first, untimed, so neither pays the first execution).",
)
flags.DEFINE_bool(
    "stream",
    False,
    "Print each prompt's text as it comes (the prompts run on spec_jax.engine.Engine, --batch_size "
    "rows at a time, a finished row's slot taken by the next prompt at once); the output is the "
    "same as without --stream.",
)
flags.DEFINE_string("output_json", None, "Write tokens, text and stats here.")
flags.DEFINE_bool(
    "skip_special_tokens", True, "Print and write text without special tokens (the token ids keep them)."
)


@dataclasses.dataclass(frozen=True)
class Job:
    """What main runs: the prompts as given, as ids and as the model reads them, the loaded
    target, what the drafter flags made (shared.Drafting: its `draft` None for plain decoding)
    and the mesh (None: one device)."""

    prompts: list[Prompt]
    token_prompts: list[list[int]]
    texts: list[str]
    target: models.Model
    drafting: shared.Drafting
    mesh: object = None

    @property
    def draft(self):
        return self.drafting.draft

    @property
    def mode(self) -> str:
        return f"speculative ({FLAGS.drafter})" if self.draft is not None else "autoregressive"


def check_flags():
    """(mesh or None, the prompts): every flag checked before anything is loaded or downloaded
    (shared.check_flags, with generate's own: --stream against --compare_autoregressive, the
    prompts, --output_json)."""

    def own() -> list[Prompt]:
        if FLAGS.stream and FLAGS.compare_autoregressive:
            raise common.UsageError("--stream and --compare_autoregressive cannot be combined")
        found = read_prompts()
        if FLAGS.output_json is not None:
            common.check_output_json(FLAGS.output_json)
        return found

    return shared.check_flags(own)


def load_job(prompts: list[Prompt], mesh) -> Job:
    """The Job: the flags' pair (shared.load_pair, the draft fetched in the background meanwhile)
    with the prompts encoded and checked against the target (and --gamma against its context)
    before a draft model or a drafter's tables are loaded, and --gamma against the draft's
    context once it is; then --drafter's drafter (shared.drafting_of)."""
    encoded = {}

    def check_target(target):
        token_prompts, texts = encode_prompts(target.tokenizer, prompts, FLAGS.target)
        validate(target, token_prompts, None, None, FLAGS.max_new_tokens, None)
        if FLAGS.drafter != "model" or FLAGS.draft != "none":
            shared.check_gamma_fits(token_prompts, {"the target's": target.config.max_seq_len})
        encoded.update(token_prompts=token_prompts, texts=texts)

    def check_draft(target, draft):
        contexts = {"the target's": target.config.max_seq_len, "the draft's": draft.config.max_seq_len}
        shared.check_gamma_fits(encoded["token_prompts"], contexts)

    batch = min(FLAGS.batch_size, len(prompts))
    pair = shared.load_pair(batch, mesh, check_target, check_draft, prefetch_draft=True)
    return Job(prompts, target=pair.target, drafting=shared.drafting_of(pair), mesh=mesh, **encoded)


def run_batches(job: Job, draft, token_prompts):
    """(tokens, pooled stats): decodes in batches of --batch_size (a smaller last batch compiles
    its own loop). Prompt i of the list draws from (--seed, i) alone, so outputs do not depend
    on the batch size."""
    outputs, stats = [], []
    size = FLAGS.batch_size
    for start in range(0, len(token_prompts), size):
        batch = token_prompts[start : start + size]
        gen = spec_jax.generate(
            job.target,
            batch,
            draft=draft,
            gamma=shared.gamma_from_flag(),
            tree=shared.tree_from_flag(),
            max_new_tokens=FLAGS.max_new_tokens,
            temperature=FLAGS.temperature,
            top_k=FLAGS.top_k,
            top_p=FLAGS.top_p,
            seed=FLAGS.seed,
            row_ids=range(start, start + len(batch)),
            eos_id=job.drafting.stop_ids,
            mesh=job.mesh,
        )
        outputs.extend(gen.tokens)
        stats.append(gen.stats)
    pooled = metrics.pool(stats)
    if "gamma_schedule" in stats[0]:  # --gamma=auto: [gamma or "treeN", rounds] chunks of each batch
        pooled["gamma_schedules"] = [s["gamma_schedule"] for s in stats]
    return outputs, pooled


def decode_all(job: Job):
    """(tokens, stats, (autoregressive tokens, stats) or None): --compare_autoregressive runs
    both modes once on the first batch, untimed, before either is timed (the first execution in
    a process pays start-up costs a later one does not); the compile seconds reported are the
    warm-up's plus any later batch's."""
    compare = FLAGS.compare_autoregressive and job.draft is not None
    warm_compile = {}
    for mode, d in (("speculative", job.draft), ("autoregressive", None)) if compare else ():
        first = job.token_prompts[: FLAGS.batch_size]
        warm_compile[mode] = run_batches(job, d, first)[1]["compile_seconds"]
    tokens, stats = run_batches(job, job.draft, job.token_prompts)
    stats["compile_seconds"] += warm_compile.get("speculative", 0.0)
    if not compare:
        return tokens, stats, None
    ar_tokens, ar_stats = run_batches(job, None, job.token_prompts)
    ar_stats["compile_seconds"] += warm_compile["autoregressive"]
    return tokens, stats, (ar_tokens, ar_stats)


def header(prompt: Prompt) -> str:
    """The line printed above a prompt's text."""
    return f"--- {'chat' if prompt.messages is not None else 'prompt'}: {prompt.shown!r}"


def stream_all(job: Job, print_fn) -> tuple[list[list[int]], dict]:
    """--stream: the prompts as Requests on one Engine, each prompt's header then its text
    printed as it comes (prompt by prompt, in order: a later prompt's pieces wait until the
    ones before it are done). Returns (each prompt's tokens, the engine's stats)."""
    engine = engine_lib.Engine(
        job.target,
        job.draft,
        max_batch=FLAGS.batch_size,
        max_queue=len(job.token_prompts),
        gamma=shared.gamma_from_flag(),
        tree=shared.tree_from_flag(),
        mesh=job.mesh,
        max_context=stream_context(job.target.config, job.token_prompts, FLAGS.max_new_tokens),
        max_new_tokens=FLAGS.max_new_tokens,
        prefix_cache_mb=0,  # generate's prefill program (a run after `make demo` finds it compiled)
    )
    settings = dict(max_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature, top_k=FLAGS.top_k)
    settings.update(top_p=FLAGS.top_p, stop_ids=tuple(job.drafting.stop_ids))
    handles = [
        engine.submit(Request(prompt_ids=tuple(p), seed=FLAGS.seed, **settings), row_id=i)
        for i, p in enumerate(job.token_prompts)
    ]
    index = {h.id: i for i, h in enumerate(handles)}
    tokens, pending, done, shown = [[] for _ in handles], [[] for _ in handles], set(), 0
    print_fn(header(job.prompts[0]))
    for update in engine.drain():
        i = index[update.handle.id]
        tokens[i] += update.token_ids
        pending[i].append(update.text)
        done |= {i} if update.finished else set()
        while shown < len(handles) and (pending[shown] or shown in done):
            print_fn("".join(pending[shown]), end="\n\n" if shown in done else "", flush=True)
            pending[shown] = []
            if shown in done:
                shown += 1
                if shown < len(handles):
                    print_fn(header(job.prompts[shown]))
    return tokens, engine.stats()


def make_report(job: Job, stats) -> dict:
    """--output_json's settings and stats (outputs and the comparison are added after)."""
    return {
        "target": FLAGS.target,
        "draft": FLAGS.draft,
        "drafter": FLAGS.drafter,
        "max_ngram": FLAGS.max_ngram,
        "draft_threshold": FLAGS.draft_threshold,
        "target_dtype": job.target.config.dtype,
        "draft_dtype": job.drafting.draft_dtype,
        "draft_vocab": job.drafting.draft_vocab,
        "matmul_impl": FLAGS.matmul_impl,
        "gamma": shared.gamma_from_flag(),
        "tree": shared.tree_from_flag(),
        "temperature": FLAGS.temperature,
        "stop_ids": job.drafting.stop_ids,
        "mesh": FLAGS.mesh,
        "stats": stats,
        "outputs": [],
    }


def main(argv):
    if len(argv) > 1:
        raise common.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    distributed.init_distributed()  # 1. before anything touches a jax backend
    mesh, prompts = check_flags()  # 2. every flag, before anything is loaded
    job = load_job(prompts, mesh)  # 3. the models, the prompts as ids, the drafter
    main_process = jax.process_index() == 0

    def print(*args, **kwargs):  # noqa: A001 - only process 0 prints
        if main_process:
            builtins.print(*args, **kwargs)

    common.note_default_prompt(prompt_flags.default_prompt_used(), DEFAULT_PROMPT)
    # 4. decode, printing: on the Engine as the text comes, or in batches
    output = stream_output(job, print) if FLAGS.stream else batch_output(job, print)
    if FLAGS.output_json and main_process:  # 5. the output file
        runtime.write_json_atomic(FLAGS.output_json, output)


def batch_output(job: Job, print_fn) -> dict:
    """Decodes in batches (decode_all), prints each prompt's text, the summary lines (and
    --compare_autoregressive's speedup), the non-finite warning on stderr; returns
    --output_json's report."""
    tokens, stats, compared = decode_all(job)
    out = make_report(job, stats)
    decode = functools.partial(job.target.tokenizer.decode, skip_special_tokens=FLAGS.skip_special_tokens)
    for prompt, read, new, nonfinite in zip(
        job.prompts, job.texts, tokens, stats[metrics.NONFINITE], strict=True
    ):
        text = decode(new)
        output = {"prompt": read, "tokens": new, "text": text, "nonfinite_logits": nonfinite}
        if prompt.messages is not None:  # "prompt" is the conversation as the template rendered it
            output["messages"] = list(prompt.messages)
        out["outputs"].append(output)
        print_fn(f"{header(prompt)}\n{common.terminal_text(text)}\n")
    print_fn(report.summary_line(job.mode, stats))
    warning = report.report_nonfinite(stats, [p.shown for p in job.prompts])
    if warning:
        print_fn(warning, file=sys.stderr)
    if compared is not None:
        ar_tokens, ar_stats = compared
        speedup = stats["tokens_per_second"] / ar_stats["tokens_per_second"]
        identical = ar_tokens == tokens
        print_fn(report.summary_line("autoregressive", ar_stats))
        print_fn(
            f"speedup {speedup:.2f}x; outputs identical to autoregressive: {identical}"
            + ("" if FLAGS.temperature == 0 else " (expected only at temperature 0)")
        )
        out.update(autoregressive_stats=ar_stats, speedup=speedup, identical_to_autoregressive=identical)
    return out


def stream_output(job: Job, print_fn) -> dict:
    """--stream's output: each prompt's header, then its text as it comes (stream_all); a
    summary line; returns --output_json's report: each prompt's tokens and text and the
    engine's stats."""
    start = time.perf_counter()
    tokens, stats = stream_all(job, print_fn)
    seconds = time.perf_counter() - start
    total = sum(len(t) for t in tokens)
    line = f"streamed {job.mode}: {total} tokens in {seconds:.2f} s ({total / seconds:.2f} tokens/s)"
    if stats.get("draft_tokens_total"):
        line += f", acceptance rate {stats['accepted_tokens_total'] / stats['draft_tokens_total']:.3f}"
    print_fn(line)
    decode = functools.partial(job.target.tokenizer.decode, skip_special_tokens=FLAGS.skip_special_tokens)
    outputs = [
        {"prompt": read, "tokens": new, "text": decode(new)}
        for read, new in zip(job.texts, tokens, strict=True)
    ]
    return {"target": FLAGS.target, "stats": stats, "outputs": outputs}


def cli():
    """The command line: main under launch.common.run (bad input: one line, exit 2)."""
    common.run(main)


if __name__ == "__main__":
    cli()
