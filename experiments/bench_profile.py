"""Benchmark: where a decode step's and a prefill chunk's time goes, by kind of work.

Three compiled programs of the model at its precision (the defaults: the Qwen2.5-Coder-1.5B
target at `gguf_q8`), each run `repeats` times after a warm-up:
  decode step     `steps` model calls of one token at position `context` (spec_jax.timing's
                  model_calls: the forward alone, nothing else, inside one program);
  prefill chunk   the loop's prefill of one prompt of `prompt_tokens` tokens (spec_prefill:
                  on the CPU kernels, chunks of PREFILL_CHUNK positions, then the first token);
  decode loop     plain greedy decoding of `max_new_tokens` tokens after that prompt (the loop
                  the defaults run: spec_loop with no drafter; gamma=auto runs this one at
                  `gguf_q8` on 2 cores, as it never drafts there), per token;
and spec_jax.generate end to end, whose decode seconds beyond the loop's program are the host's.

Each repeat runs once untimed by the profiler (its wall time) and once under jax.profiler: XLA's
CPU runtime records every thunk (a fusion, a custom call, a copy, the loop's control) by its
HLO instruction's name. Each instruction is given a kind from the compiled HLO (the custom
call's target, the op_name of named scopes and Flax modules, and the Python function that
emitted it, from the module's stack frames): KINDS below. A thunk's self time (its time less
the thunks nested in it) goes to its kind; the executors' own time between thunks is
"thunk dispatch"; what the wall time holds beyond the profiled program (argument handling,
dispatch, the result's wait) is "host". Medians over the repeats, per decode token or per
prefill chunk; the profiled run is slower than the untimed one by the profiler's own cost
(about a microsecond a thunk), which `remainder` (wall less everything attributed) shows.
"""

import collections
import functools
import glob
import os
import re
import statistics
import tempfile
import time

import jax
import ml_collections

import spec_jax
from experiments import bench_loop, common, framework
from models.transformer import init_cache
from spec_jax import timing
from spec_jax.decode import PREFILL_CHUNK
from spec_jax.speculative import spec_loop, spec_prefill

TITLE = "Benchmark profile: a decode step's and a prefill chunk's time by kind of work"

KINDS = (
    "GGUF / matrix products (q, k, v, o, gate, up, down)",
    "attention (the kernel)",
    "attention: KV cache layer copies",
    "KV cache writes",
    "norms (RMSNorm kernel)",
    "rope",
    "activations, residuals, biases",
    "embedding lookup",
    "lm head",
    "sampling and the rule (warp, verify, draw)",
    "loop bookkeeping (commit, stop checks, metrics, control)",
    "thunk dispatch (XLA's executor between thunks)",
    "host (dispatch, arguments, waiting for the result)",
)
PRODUCT_TARGETS = ("spec_jax_gguf_matmul", "spec_jax_matmul_")
SAMPLING_FILES = ("spec_jax/sampling.py", "spec_jax/verify.py", "spec_jax/tree.py")

MODEL_KEYS = ("model",)
DTYPE_KEYS = ("dtype",)
INT_RANGES = {
    "context": (1, 1 << 15),
    "steps": (1, 256),
    "prompt_tokens": (1, 1 << 15),
    "max_new_tokens": (2, 4096),
    "repeats": (1, 1000),
}


def get_config(quick: bool = False) -> ml_collections.ConfigDict:
    """The target at the defaults' precision; tiny and float32 when quick."""
    config = ml_collections.ConfigDict()
    config.model = "tiny" if quick else "qwen2.5-coder-1.5b"
    config.dtype = "float32" if quick else "gguf_q8"  # models.precision.PRECISIONS
    config.context = 16 if quick else 64  # cache positions before the profiled decode step
    config.steps = 2 if quick else 8  # decode steps per profiled program
    config.prompt_tokens = 32 if quick else 64  # the prefill's prompt (chunks of PREFILL_CHUNK)
    config.max_new_tokens = 8 if quick else 64  # the decode loop's tokens
    config.repeats = 2 if quick else 5
    return config


@functools.cache
def _parse_tables(text: str):
    """(file names, function names, {location: (file id, function id)}, {frame: (location, parent)})
    of an HLO module's stack-frame tables (ids as printed; a frame's printed parent is its
    parent's id + 1, 0 for none)."""
    tables, section = collections.defaultdict(dict), None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            continue
        if section is None or not line or not line[0].isdigit():
            section = None if not line or line.startswith(("HloModule", "ENTRY", "%")) else section
            continue
        key, rest = line.split(" ", 1)
        tables[section][int(key)] = rest
    files = {k: v.strip('"') for k, v in tables["FileNames"].items()}
    functions = {k: v.strip('"') for k, v in tables["FunctionNames"].items()}

    def ints(text, *names):
        return tuple(int(re.search(rf"{n}=(\d+)", text).group(1)) for n in names)

    locations = {k: ints(v, "file_name_id", "function_name_id") for k, v in tables["FileLocations"].items()}
    frames = {k: ints(v, "file_location_id", "parent_frame_id") for k, v in tables["StackFrames"].items()}
    return files, functions, locations, frames


def call_stack(text: str, frame_id: int) -> list[tuple[str, str]]:
    """[(file, function)] of an instruction's stack frame, innermost first."""
    files, functions, locations, frames = _parse_tables(text)
    stack, seen = [], set()
    while frame_id in frames and frame_id not in seen:
        seen.add(frame_id)
        location, parent = frames[frame_id]
        file_id, function_id = locations[location]
        stack.append((files.get(file_id, ""), functions.get(function_id, "")))
        frame_id = parent - 1
    return stack


INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? ([\w\-]+)\(")


def instructions(text: str) -> dict[str, dict]:
    """{instruction name: {"op", "target", "op_name", "stack"}} of every instruction of an
    optimized HLO module's text (compiled.as_text())."""
    out = {}
    for line in text.splitlines():
        match = INSTRUCTION.match(line)
        if not match:
            continue
        target = re.search(r'custom_call_target="([^"]+)"', line)
        op_name = re.search(r'op_name="([^"]*)"', line)
        frame = re.search(r"stack_frame_id=(\d+)", line)
        out[match.group(1)] = {
            "op": match.group(2),
            "target": target.group(1) if target else "",
            "op_name": op_name.group(1) if op_name else "",
            "stack": call_stack(text, int(frame.group(1))) if frame else [],
        }
    return out


def kind_of(instr: dict) -> str:
    """The KINDS entry of one HLO instruction (instructions())."""
    target, op_name, stack = instr["target"], instr["op_name"], instr["stack"]
    functions = {f for _, f in stack}
    files = {f for f, _ in stack}
    in_model = "forward" in functions or "/Transformer/" in op_name
    if target.startswith(PRODUCT_TARGETS):
        return KINDS[8] if "lm_head" in op_name else KINDS[0]
    if "attention" in target:
        return KINDS[1]
    if "rms_norm" in target:
        return KINDS[4]
    if "gguf_rows" in target or "/embed/" in op_name:
        return KINDS[7]
    if in_model:
        if "cache_write" in op_name:
            return KINDS[3]
        if "/attention/" in op_name:
            return KINDS[2]
        if "lm_head" in op_name:
            return KINDS[8]
        return KINDS[5] if "rotary" in functions else KINDS[6]
    if any(f.endswith(SAMPLING_FILES) for f in files):
        return KINDS[9]
    return KINDS[10]


def trace_events(run) -> tuple[float, list]:
    """(wall seconds of run(), [(thread, name, start_ns, duration_ns)] of the host CPU plane):
    run() called once under jax.profiler, its result waited for."""
    with tempfile.TemporaryDirectory() as folder:
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0  # Python's calls would slow the host side many times over
        jax.profiler.start_trace(folder, profiler_options=options)
        start = time.perf_counter()
        jax.block_until_ready(run())
        wall = time.perf_counter() - start
        jax.profiler.stop_trace()
        (path,) = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
    events = []
    for plane in data.planes:
        if plane.name == "/host:CPU":
            for line in plane.lines:
                events += [(line.name, e.name, e.start_ns, e.duration_ns) for e in line.events]
    return wall, events


def self_times(events) -> list[tuple[str, float]]:
    """[(name, self ns)] of every event: its duration less its nested events' (per thread)."""
    out = []
    by_thread = collections.defaultdict(list)
    for thread, name, start, duration in events:
        by_thread[thread].append((start, -duration, name))
    for evs in by_thread.values():
        stack = []  # [end, name, self]
        for start, neg, name in sorted(evs):
            while stack and stack[-1][0] <= start:
                end, n, s = stack.pop()
                out.append((n, s))
            if stack:
                stack[-1][2] -= -neg
            stack.append([start - neg, name, -neg])
        out += [(n, s) for _, n, s in stack]
    return out


def attribute(wall: float, events, instrs: dict, classify=kind_of, kinds=KINDS) -> dict:
    """{kind: seconds} of one profiled run: each thunk's self time by classify (an instruction
    -> one of kinds), the executors' self time as dispatch (kinds[-2]), the wall time beyond the
    outermost executor call as host (kinds[-1])."""
    seconds = dict.fromkeys(kinds, 0.0)
    for name, ns in self_times(events):
        if name in instrs:
            seconds[classify(instrs[name])] += ns / 1e9
        elif name == "ThunkExecutor::Execute":
            seconds[kinds[-2]] += ns / 1e9
    outer = [d for _, n, _, d in _outermost(events) if n == "ThunkExecutor::Execute"]
    seconds[kinds[-1]] = max(wall - sum(outer) / 1e9, 0.0)
    return seconds


def _outermost(events):
    """The events not nested in another event of their thread."""
    out = []
    by_thread = collections.defaultdict(list)
    for ev in events:
        by_thread[ev[0]].append(ev)
    for evs in by_thread.values():
        end = -1
        for ev in sorted(evs, key=lambda e: (e[2], -e[3])):
            if ev[2] >= end:
                out.append(ev)
                end = ev[2] + ev[3]
    return out


def profile_program(
    name: str, compiled, run, repeats: int, per: float, prepare=lambda: None, classify=kind_of, kinds=KINDS
) -> dict:
    """{"program", "wall_ms", "cpu_ms", kinds..., "remainder_ms"} in ms per unit (a run's work over
    `per`), medians over repeats: run() untimed by the profiler for the wall time (and this
    process's CPU time, which other jobs on a shared machine move less), then once under it for
    the kinds (attribute's classify and kinds); prepare() before each run, untimed (a fresh
    donated input)."""
    instrs = instructions(compiled.as_text())
    prepare()
    jax.block_until_ready(run())  # warm-up
    walls, cpus, profiles = [], [], []
    for _ in range(repeats):
        prepare()
        start, cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(run())
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
        prepare()
        profiles.append(attribute(*trace_events(run), instrs, classify, kinds))
    row = {"program": name, "wall_ms": 1e3 * statistics.median(walls) / per}
    row["cpu_ms"] = 1e3 * statistics.median(cpus) / per
    for kind in kinds:
        row[kind] = 1e3 * statistics.median(k[kind] for k in profiles) / per
    row["remainder_ms"] = row["wall_ms"] - sum(row[k] for k in kinds)
    return row


def census(compiled) -> dict:
    """Thunk counts of a compiled program by kind, custom call target and XNNPACK (__ynn) fusion."""
    instrs = instructions(compiled.as_text())
    counted = [
        i for i in instrs.values() if i["op"] in ("fusion", "custom-call", "copy", "dynamic-update-slice")
    ]
    counts = collections.Counter(kind_of(i) for i in counted)
    targets = collections.Counter(i["target"] for i in counted if i["target"])
    ynn = sum("__ynn" in n for n in instrs)
    return {"kinds": dict(counts), "custom_calls": dict(targets), "ynn_fusions": ynn, "thunks": len(counted)}


def _runner(fn, *args, donate=()):
    """(compiled, call(*args) -> result) of jax.jit(fn) lowered for these arguments."""
    compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    return compiled, compiled


def decode_step(model, config) -> dict:
    """The profile row of `steps` decode steps (model calls alone) at position `context`."""
    cfg, slots = model.config, 2 * config.context
    calls = timing.model_calls(cfg, batch=1, widths=[1], cache_slots=slots, repeat=config.steps)
    compiled, call = _runner(calls, model.params, init_cache(cfg, 1, slots), donate=(1,))
    box = {"cache": init_cache(cfg, 1, slots)}

    def run():
        box["cache"], logits = call(model.params, box["cache"])
        return logits

    row = profile_program("decode step (model call)", compiled, run, config.repeats, config.steps)
    return row, census(compiled)


def prompt_of(config) -> list[int]:
    """A synthetic prompt of prompt_tokens token ids in [1, 50]."""
    return [1 + (7 * j) % 50 for j in range(config.prompt_tokens)]


def prefill_and_loop(model, config) -> list[dict]:
    """The profile rows of the loop's prefill (per chunk) and of its plain decoding (per token)."""
    n = config.max_new_tokens
    static, inputs = bench_loop.plain_loop_setup(model, [prompt_of(config)], n)
    params = model.params
    prefill, _ = _runner(functools.partial(spec_prefill, static), params, (), inputs)
    chunks = -(-config.prompt_tokens // PREFILL_CHUNK)
    rows = [
        profile_program("prefill chunk", prefill, lambda: prefill(params, (), inputs), config.repeats, chunks)
    ]
    state = prefill(params, (), inputs)
    loop, _ = _runner(functools.partial(spec_loop, static), params, (), state, inputs.stop_ids, donate=(2,))
    box = {}

    def run():
        return loop(params, (), box.pop("state"), inputs.stop_ids)

    def fresh():
        box["state"] = jax.block_until_ready(prefill(params, (), inputs))

    rows.append(profile_program("decode loop, per token", loop, run, config.repeats, n - 1, prepare=fresh))
    return rows


def generate_row(model, config, loop_row: dict) -> dict:
    """spec_jax.generate's decode seconds per token (plain, greedy: what the defaults run here),
    median over repeats, and what they hold beyond the loop's program (host)."""
    n = config.max_new_tokens
    kwargs = dict(max_new_tokens=n, temperature=0.0)
    spec_jax.generate(model, [prompt_of(config)], **kwargs)  # compiles
    seconds = [
        spec_jax.generate(model, [prompt_of(config)], **kwargs).stats["decode_seconds"]
        for _ in range(config.repeats)
    ]
    wall = 1e3 * statistics.median(seconds) / (n - 1)
    return {"program": "generate(), decode per token", "wall_ms": wall, KINDS[12]: wall - loop_row["wall_ms"]}


def kinds_table(rows: list[dict]) -> list[dict]:
    """The profile transposed: one row per kind of work, a column (ms) and its share per program."""
    table = []
    for kind in (*KINDS, "remainder_ms", "wall_ms"):
        line = {
            "kind of work": {"remainder_ms": "remainder (wall less the above)", "wall_ms": "wall"}.get(
                kind, kind
            )
        }
        for row in rows:
            if kind in row:
                line[f"{row['program']} (ms)"] = row[kind]
                line[f"{row['program']} (share)"] = row[kind] / row["wall_ms"]
        table.append(line)
    return table


def run(config) -> framework.Result:
    model = common.load_model(config.model, config.dtype)
    step, counts = decode_step(model, config)
    prefill_row, loop_row = prefill_and_loop(model, config)
    rows = [step, prefill_row, loop_row, generate_row(model, config, loop_row)]
    for row in rows:
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    thunks = [{"kind of work": k, "thunks per decode step": v} for k, v in sorted(counts["kinds"].items())]
    calls = [
        {"custom call target": k, "calls per decode step": v}
        for k, v in sorted(counts["custom_calls"].items())
    ]
    note = (
        f"Decode step at position {config.context}; prefill of a {config.prompt_tokens}-token prompt in "
        f"chunks of {PREFILL_CHUNK}; the loop's {config.max_new_tokens} tokens after it. "
        f"XNNPACK (__ynn) fusions in the decode step: {counts['ynn_fusions']}; thunks: {counts['thunks']}."
    )
    return framework.Result.from_dicts(
        kinds_table(rows),
        markdown=note,
        sections={"thunks of one decode step by kind": thunks, "custom calls of one decode step": calls},
        summary={"programs": rows, "census": counts},
    )
