"""The command line: runs end to end, and bad flags exit 2 with one line and no traceback."""

import json
import os
import subprocess
import sys

import pytest
from conftest import cache_with_kernels, cli_case

from spec_jax import executables

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, module="launch.generate", env=None):
    """Runs the CLI on the random presets (later flags override), so no download is needed."""
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", **(env or {})}
    # gamma 4: the default, auto, would first measure the random pair's costs (tests/test_autogamma.py)
    models = ["--target=random", "--draft=random-draft", "--gamma=4"] if module == "launch.generate" else []
    return subprocess.run(
        [sys.executable, "-m", module, *models, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )


RANDOM_PAIR = ["--target=random", "--draft=random-draft", "--gamma=4"]

BAD_INPUT = [
    (["--gamma=0"], "--gamma"),
    (["--gamma=many"], "--gamma must be an integer >= 1 or 'auto'"),
    (["--target_dtype=fp8"], "--target_dtype"),
    (["--draft_vocab=100000"], "--draft_vocab must be 0 or in [1, 512]"),
    (["--draft_vocab=-3"], "--draft_vocab must be 'auto', 0 or a positive token count"),
    (["--top_p=0"], "--top_p"),
    (["--top_k=-1"], "--top_k"),
    (["--temperature=-1"], "--temperature"),
    (["--max_new_tokens=0"], "--max_new_tokens"),
    (
        ["--seed=99999999999999999999999"],
        "99999999999999999999999 is not an integer in the range",
    ),
    (["--target=nope"], "known models"),
    (["--no_such_flag"], "no_such_flag"),
    (["--prompt="], "empty"),
    (["--max_new_tokens=4000"], "context"),
    (["--prompts_file=/nonexistent.jsonl"], "--prompts_file"),
    (["--attention_impl=cuda"], "attention impl"),
    (["--stop_ids=1,x"], "--stop_ids"),
    (["--stop_ids=600"], "--stop_ids"),
    (["--stream", "--compare_autoregressive"], "--stream and --compare_autoregressive"),
    (
        ["--drafter=lookahead"],
        "--drafter=lookahead: value should be one of <model|head|prompt_lookup|suffix|hybrid",
    ),
    (["--max_ngram=0"], "--max_ngram=0: 0 is not an integer in the range [1, 16]"),
    (["--draft_threshold=1"], "--draft_threshold must be in [0, 1)"),
    (["--drafter=hybrid", "--draft=none"], "--drafter=hybrid needs a draft model"),
    (["--acceptance_head"], "--acceptance_head needs --drafter=head"),
    (["--drafter=head", "--head_dir=/nonexistent"], "--drafter=head: no trained head in /nonexistent"),
    (["--tree=32"], "--tree must be 0 (chains), a node count in [1, 31] or 'auto', got '32'"),
    (["--tree=3", "--draft=none"], "--tree needs a drafter: --draft cannot be 'none'"),
    (["--tree=30", "--max_new_tokens=2000"], "--tree must be in [1, "),
]


# Files the refusals below read, written once per test process.
CHAT_LINES = {
    "bad_entry": '{"messages": [{"role": "user"}]}',
    "empty": '{"messages": []}',
    "both": '{"prompt": "x", "messages": []}',
    "no_template": '{"messages": [{"role": "user", "content": "x"}]}',
    "chat_no_template": '{"prompt": "x"}',
}


@pytest.fixture(scope="module")
def case_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli_cases")
    files = {}
    for name, line in CHAT_LINES.items():
        files[name] = folder / f"{name}.jsonl"
        files[name].write_text('{"prompt": "ok"}\n' + line + "\n")
    files["not_utf8"] = folder / "not_utf8.jsonl"
    files["not_utf8"].write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xff"}\n')
    files["bad_line"] = folder / "bad_line.jsonl"
    files["bad_line"].write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
    for name, text in RUN_PROMPTS.items():
        (folder / name).write_text(text)
    files["folder"] = folder
    return files


MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
# The prompts files of the runs below (written by case_files).
RUN_PROMPTS = {
    "two.jsonl": '{"prompt": "abc"}\n{"prompt": "hello world"}\n',
    "twins.jsonl": '{"prompt": "abc"}\n{"prompt": "abc"}\n{"prompt": "hello"}\n',
    "three.jsonl": '{"prompt": "abc"}\n{"prompt": "hello world"}\n{"prompt": "x"}\n',
    "poisoned.jsonl": '{"prompt": "abc"}\n{"prompt": "aZc"}\n',
    "messages.jsonl": json.dumps({"prompt": "ab"}) + "\n" + json.dumps({"messages": MESSAGES}) + "\n",
}


def runs(folder) -> dict:
    """{name: a cli_driver case}: the runs of launch.generate that decode, which the tests below
    read from case_args's one process (its start, imports and compiled programs paid once), some
    with a prelude patching the entry point as a script would. Each writes folder/NAME.json."""
    out = {name: f"--output_json={folder / name}.json" for name in ("json", "strict", "batch", "stream")}
    sampled = [*RANDOM_PAIR, f"--prompts_file={folder / 'three.jsonl'}", "--batch_size=2"]
    sampled += ["--max_new_tokens=7", "--temperature=1"]
    cases = {
        "json": [
            *RANDOM_PAIR,
            f"--prompts_file={folder / 'two.jsonl'}",
            "--max_new_tokens=6",
            "--batch_size=2",
        ]
        + ["--temperature=0", "--compare_autoregressive", out["json"]],
        "strict": [*RANDOM_PAIR, "--draft=none", "--prompt=abc", "--max_new_tokens=3", out["strict"]],
        "batch": [*sampled, out["batch"]],
        "stream": [*sampled, "--stream", out["stream"]],
    }
    for batch_size in (1, 2, 3):  # plain decoding, sampled
        cases[f"seed_batch{batch_size}"] = [
            *["--target=random", f"--prompts_file={folder / 'twins.jsonl'}", f"--batch_size={batch_size}"],
            *["--max_new_tokens=8", "--temperature=1", "--draft=none", "--seed=3"],
            f"--output_json={folder / f'seed_batch{batch_size}.json'}",
        ]
    poisoned = ["--target=random", "--target_dtype=float32", "--draft=none", "--temperature=0"]
    poisoned += [f"--prompts_file={folder / 'poisoned.jsonl'}", "--max_new_tokens=4", "--batch_size=2"]
    cases["poisoned"] = {
        "args": [*poisoned, f"--output_json={folder / 'poisoned.json'}"],
        "prelude": POISONED,
    }
    paired = ["--target=random", "--draft=random-draft", "--gamma=2", "--prompt=ab", "--max_new_tokens=4"]
    cases["renamed"] = {"args": paired, "prelude": PAIRED, "extra": {"mode": "renamed"}}
    cases["prefix"] = {"args": [*paired, "--temperature=0"], "prelude": PAIRED, "extra": {"mode": "prefix"}}
    chat = ["--target=random", "--draft=random-draft", "--gamma=3", "--temperature=0", "--max_new_tokens=6"]
    chat_runs = {
        "chat": [
            "--chat",
            "--prompt=ab",
            "--compare_autoregressive",
            f"--output_json={folder / 'chat.json'}",
        ],
        "messages": [f"--prompts_file={folder / 'messages.jsonl'}", "--batch_size=2"],
    }
    for name, args in chat_runs.items():
        extra = {"log": str(folder / f"{name}.log"), "template": CHAT_TEMPLATE}
        cases[name] = {"args": [*chat, *args], "prelude": CHAT, "extra": extra}
    return cases


def case_args(files) -> list[list[str]]:
    """Every refusal of launch.generate that needs no environment of its own: run in one process
    (conftest.cli_case), each as `python -m launch.generate` sees it."""
    cases = [RANDOM_PAIR + a for a, _ in BAD_INPUT]
    cases += [
        RANDOM_PAIR + [f"--prompts_file={files[name]}"] for name in CHAT_LINES if name != "chat_no_template"
    ]
    cases += [
        RANDOM_PAIR + [f"--prompts_file={files['chat_no_template']}", "--chat"],
        RANDOM_PAIR + [f"--prompts_file={files['not_utf8']}"],
        RANDOM_PAIR + [f"--prompts_file={files['bad_line']}"],
        RANDOM_PAIR + ["--target=no-such-model", f"--output_json={files['folder'] / 'missing' / 'out.json'}"],
        RANDOM_PAIR + ["--target=no-such-model", f"--output_json={files['folder']}"],
    ]
    cases += [
        RANDOM_PAIR + [f"--drafter={d}", "--gamma=2042", "--prompt=abc", "--max_new_tokens=4"]
        for d in LONG_GAMMA
    ]
    cases += [RANDOM_PAIR + ["--target=random", "--draft=smollm2-135m"]]
    return cases + list(runs(files["folder"]).values())


def generate_case(files, *args):
    return cli_case("launch.generate", case_args(files), RANDOM_PAIR + list(args))


def generate_run(files, name):
    """The result of runs(...)[name], run in the one process of case_args."""
    return cli_case("launch.generate", case_args(files), runs(files["folder"])[name])


# The tests reading case_args's process: one xdist group, so that one pytest worker runs it.
in_one_process = pytest.mark.xdist_group("cli_cases")


@in_one_process
@pytest.mark.parametrize("args, message", BAD_INPUT)
def test_bad_input_exits_2_with_one_line(case_files, args, message):
    result = generate_case(case_files, *args)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.stderr


@in_one_process
def test_generate_runs_and_writes_json(case_files):
    result = generate_run(case_files, "json")
    assert result.returncode == 0, result.stderr
    report = json.loads((case_files["folder"] / "json.json").read_text())
    assert len(report["outputs"]) == 2
    assert report["identical_to_autoregressive"] is True
    assert "acceptance rate" in result.stdout and "speedup" in result.stdout


@in_one_process
def test_output_json_is_strict_json_with_the_users_permissions(case_files):
    """--draft=none has no acceptance rate: the file says null, not a bare NaN that strict JSON
    parsers reject; and the file gets the umask's permissions, not mkstemp's 0600."""
    out = case_files["folder"] / "strict.json"
    result = generate_run(case_files, "strict")
    assert result.returncode == 0, result.stderr

    def reject(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    report = json.loads(out.read_text(), parse_constant=reject)
    assert report["stats"]["acceptance_rate"] is None
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask


@in_one_process
def test_a_prompts_file_that_is_not_utf8_names_the_flag_file_and_line(case_files):
    prompts = case_files["not_utf8"]
    result = generate_case(case_files, f"--prompts_file={prompts}")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"generate.py: error: --prompts_file {prompts} line 2: not UTF-8 (byte 0xff at column 16)"
    ]


@in_one_process
@pytest.mark.parametrize("target", ["missing/out.json", "."])
def test_a_bad_output_path_is_refused_before_any_model_is_loaded(case_files, target):
    out = case_files["folder"] / "missing" / "out.json" if target != "." else case_files["folder"]
    result = generate_case(case_files, "--target=no-such-model", f"--output_json={out}")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "--output_json" in result.stderr and "no-such-model" not in result.stderr


@in_one_process
def test_draft_with_another_tokenizer_is_refused(case_files):
    """SmolLM2 (49k vocabulary) cannot draft for a random 512-token model, nor Qwen for SmolLM2."""
    result = generate_case(case_files, "--target=random", "--draft=smollm2-135m")
    assert result.returncode == 2
    assert "do not share a tokenizer and vocabulary" in result.stderr
    # On a fresh machine the first run downloads and converts SmolLM2: its progress bars, the
    # background fetch's line and the conversion's one-line report are not errors.
    lines = [
        line
        for line in result.stderr.splitlines()
        if line.strip() and "%|" not in line and not line.startswith(("converted ", "fetching the draft "))
    ]
    assert len(lines) == 1, result.stderr


@in_one_process
def test_a_prompts_sample_depends_on_the_seed_and_its_index_not_the_batch_size(case_files):
    """Temperature 1, three prompts (two identical) at batch sizes 1, 2 and 3: each prompt's
    sample is the same whatever the batch size, and the two identical prompts differ. (Plain
    decoding: the speculative loop is the same loop with a drafter, and draws per row alike.)"""
    folder = case_files["folder"]
    for batch_size in (1, 2, 3):
        result = generate_run(case_files, f"seed_batch{batch_size}")
        assert result.returncode == 0, result.stderr
    outputs = {
        b: [o["tokens"] for o in json.loads((folder / f"seed_batch{b}.json").read_text())["outputs"]]
        for b in (1, 2, 3)
    }
    assert outputs[1] == outputs[2] == outputs[3]
    assert outputs[1][0] != outputs[1][1]


@in_one_process
def test_stream_prints_each_prompt_as_it_comes_and_equals_the_batch_run(case_files):
    """--stream (the engine, 2 slots for 3 prompts): the same sampled tokens as the batch path
    (prompt i draws from (--seed, i) either way), each prompt's header and text printed in
    order, and a streamed summary line."""
    folder = case_files["folder"]
    results = {name: generate_run(case_files, name) for name in ("batch", "stream")}
    for result in results.values():
        assert result.returncode == 0, result.stderr
    batch, stream = (json.loads((folder / f"{n}.json").read_text())["outputs"] for n in ("batch", "stream"))
    assert [o["tokens"] for o in stream] == [o["tokens"] for o in batch]
    streamed = results["stream"].stdout
    headers = [streamed.index(f"--- prompt: {p!r}") for p in ("abc", "hello world", "x")]
    assert headers == sorted(headers) and "streamed speculative (model): 21 tokens" in streamed


@in_one_process
def test_bad_prompts_file_line_is_reported_with_its_number(case_files):
    result = generate_case(case_files, f"--prompts_file={case_files['bad_line']}")
    assert result.returncode == 2
    assert "line 2" in result.stderr


@pytest.mark.parametrize("module", ["launch.generate", "launch.bench"])
def test_registry_unreachable_is_one_line_exit_1_and_leaves_the_cache_empty(tmp_path, module):
    # A real model into an empty cache, with pip pointed at a port where nothing listens.
    flags = ["--target=smollm2-135m", "--draft=none"] if module == "launch.generate" else ["--suite=decode"]
    env = {
        "SPEC_JAX_CACHE": str(cache_with_kernels(tmp_path / "cache")),
        "SPEC_JAX_PIP_INDEX": "http://127.0.0.1:9/simple",
        "SPEC_JAX_PIP_ARGS": "--retries=0 --timeout=2",
    }
    result = run_cli(*flags, module=module, env=env)
    lines = [line for line in result.stderr.splitlines() if line.strip() and "%|" not in line]
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1 and "could not download" in lines[0], result.stderr
    # Nothing of the model is left but its empty lock files (registry.file_lock: removing a lock
    # file others may hold is a race); the CPU matmul kernel, complete, may be (built before).
    left = [
        p
        for p in (tmp_path / "cache").rglob("*")
        if p.is_file()
        and p.parent.name != "kernels"
        and not (p.name.startswith(".lock-") and p.stat().st_size == 0)
    ]
    assert not left, left


def test_cache_folder_that_cannot_be_written_is_one_line_exit_1(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result = run_cli("--target=smollm2-135m", "--draft=none", env={"SPEC_JAX_CACHE": str(blocker)})
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "is not writable" in lines[0] and "SPEC_JAX_CACHE" in lines[0], lines


@pytest.mark.xdist_group("cli_trained_head")
def test_a_head_trained_with_launch_train_drafts_for_launch_generate(tmp_path, cli_trained_head):
    """The newcomer's path: train a (tiny) draft head for the random target with launch.train
    (conftest.cli_trained_head), then decode with it; greedy output equals plain decoding."""
    head_dir, _ = cli_trained_head
    out = tmp_path / "gen.json"
    head = ["--drafter=head", f"--head_dir={head_dir}"]
    gen_args = [*RANDOM_PAIR, *head, "--compare_autoregressive", "--max_new_tokens=12", "--prompt=def f(x):"]
    gen_args.append(f"--output_json={out}")
    # One process, the refusal first: it sees what a fresh process's would (no orbax warning yet).
    other_args = [*RANDOM_PAIR, "--target=random-draft", *head, "--prompt=x"]
    gen = cli_case("launch.generate", [other_args, gen_args], gen_args)
    assert gen.returncode == 0, gen.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["drafter"] == "head" and report["identical_to_autoregressive"] is True
    assert report["stats"]["fraction_of_rounds_by_drafter"] == {"head": 1.0}
    other = cli_case("launch.generate", [other_args, gen_args], other_args)
    lines = other.stderr.strip().splitlines()
    assert other.returncode == 2 and len(lines) == 1, other.stderr  # no orbax warnings before it
    assert "was trained for target 'random'" in lines[0] and "not for 'random-draft'" in lines[0], lines[0]


BAD_NAMES = [
    (["--draft=nosuch"], "--draft: unknown model 'nosuch'; known models: "),
    (["--draft=none", "--temperature=nan"], "--temperature must be a finite number >= 0"),
    (["--draft=none", "--temperature=inf"], "--temperature must be a finite number >= 0"),
]


@pytest.fixture(scope="module")
def empty_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("empty") / "cache"


@pytest.mark.parametrize("args, message", BAD_NAMES)
@in_one_process
def test_bad_names_and_warps_are_refused_before_anything_is_downloaded(empty_cache, args, message):
    """A real target into an empty cache, with the registry unreachable: the usage error comes
    first (it used to come after a download attempt, or instead of it as exit 1). The cases run
    in one process, on one cache."""
    env = {
        "SPEC_JAX_CACHE": str(empty_cache),
        "SPEC_JAX_PIP_INDEX": "http://127.0.0.1:9/simple",
        "SPEC_JAX_PIP_ARGS": "--retries=0 --timeout=2",
    }
    cases = [[*RANDOM_PAIR, "--target=smollm2-135m", *a] for a, _ in BAD_NAMES]
    result = cli_case("launch.generate", cases, [*RANDOM_PAIR, "--target=smollm2-135m", *args], env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr
    cache = empty_cache
    # Nothing fetched: only the CPU matmul kernel and compiled programs may be there.
    fetched = [p for p in cache.rglob("*") if p.is_file() and p.relative_to(cache).parts[0] not in KEPT]
    assert not fetched, fetched


KEPT = ("kernels", "compilation")


LONG_GAMMA = ["prompt_lookup", "unigram"]


@in_one_process
@pytest.mark.parametrize("drafter", LONG_GAMMA)
def test_gamma_beyond_the_targets_context_is_refused_for_model_free_drafters(case_files, drafter):
    result = generate_case(
        case_files, f"--drafter={drafter}", "--gamma=2042", "--prompt=abc", "--max_new_tokens=4"
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [
        "generate.py: error: --gamma must be in [1, 2041] here (the longest prompt (3 tokens) + "
        "max_new_tokens (4) + --gamma must fit the target's context of 2048 tokens), got 2042"
    ]


# launch.generate with the random target's embedding row of "Z" set to NaN: a prompt holding a Z
# gives NaN logits from its prefill on.
POISONED = """
import jax.numpy as jnp
from launch import loading
load = loading.load_model
def poisoned(name, dtype, *args, **kwargs):
    model = load(name, dtype, *args, **kwargs)
    table = model.params["embed"]["embedding"]
    return model.replace(params={**model.params, "embed": {"embedding": table.at[ord("Z")].set(jnp.nan)}})
patch(loading, "load_model", poisoned)
"""


@in_one_process
def test_a_prompt_whose_logits_turn_nan_is_named_in_one_warning_line_and_in_the_json(case_files):
    out = case_files["folder"] / "poisoned.json"
    result = generate_run(case_files, "poisoned")
    assert result.returncode == 0, result.stderr
    # The compile notice comes first where the compile takes over 2 s (a busy machine): not a warning.
    lines = [line for line in result.stderr.strip().splitlines() if line != executables.COMPILE_NOTICE]
    assert lines == [
        "warning: the target's logits became NaN or infinite for 1 of 2 prompts (by index from 0: "
        "1 ('aZc')); each stopped there and its output is cut short (check the --target weights and "
        "--target_dtype)"
    ]
    report = json.loads(out.read_text())
    assert [o["nonfinite_logits"] for o in report["outputs"]] == [False, True]
    assert report["stats"]["nonfinite_logits"] == [False, True]
    assert len(report["outputs"][0]["tokens"]) == 4 and report["outputs"][1]["tokens"] == []


TRAIN_CONFIGS = {"missing": None, "syntax_error": "def get_config(:\n"}


@pytest.fixture(scope="module")
def train_configs(tmp_path_factory):
    """{name: the path of a config.py}, each as TRAIN_CONFIGS says (None: no such file)."""
    paths = {}
    for name, source in TRAIN_CONFIGS.items():
        paths[name] = tmp_path_factory.mktemp(name) / "config.py"
        if source is not None:
            paths[name].write_text(source)
    return paths


@pytest.mark.parametrize(
    "name, message",
    [
        ("missing", "flag --config={path}: no such config file: {path}"),
        ("syntax_error", "flag --config={path}: {path} line 1: SyntaxError: invalid syntax"),
    ],
    ids=["missing", "syntax_error"],
)
@in_one_process
def test_a_train_config_that_is_missing_or_not_python_is_one_line_exit_2(train_configs, name, message):
    path = train_configs[name]
    cases = [[f"--config={p}"] for p in train_configs.values()]
    result = cli_case("launch.train", cases, [f"--config={path}"])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == ["train.py: error: " + message.format(path=path)]


PAIRED = """
import models
from launch import loading
mode = extra["mode"]
class Renamed(models.ByteTokenizer):
    def id_to_token(self, i):
        return "hi" if i == 65 else super().id_to_token(i)
load = loading.load_model
def paired(name, dtype, *args, **kwargs):
    model = load(name, dtype, *args, **kwargs)
    if name != "random-draft":
        return model
    if mode == "renamed":
        return model.replace(tokenizer=Renamed())
    small = models.random_model(vocab_size=384, num_layers=1, d_model=64, num_heads=4, num_kv_heads=2, seed=1)
    return small.replace(tokenizer=models.ByteTokenizer())  # a prefix of the target's 512 ids
patch(loading, "load_model", paired)
"""


@in_one_process
def test_a_draft_differing_in_one_token_is_refused_in_one_line_and_a_prefix_draft_runs(case_files):
    refused = generate_run(case_files, "renamed")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    [line] = refused.stderr.strip().splitlines()
    assert line.endswith(
        "--draft=random-draft and --target=random: the draft and the target do not share a tokenizer "
        "and vocabulary: token id 65 is '<0x41>' in the target's and 'hi' in the draft's (the draft's "
        "vocabulary must be the target's or a prefix of it)"
    )
    accepted = generate_run(case_files, "prefix")
    assert accepted.returncode == 0, accepted.stderr


# launch.generate with both random models given the tiny GGUF's tokenizer (tests/tiny_gguf.py)
# carrying CHAT_TEMPLATE and add_bos_token, and every token prompt generate receives written to
# the file named by argv[1].
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CHAT = """
import json, pathlib
import spec_jax, tiny_gguf
from launch import loading
from models.tokenizer import Tokenizer
log = pathlib.Path(extra["log"])
path = log.with_suffix(".gguf")
tiny_gguf.write(path, chat_template=extra["template"], add_bos=True)
tokenizer = Tokenizer.from_gguf(path)
load = loading.load_model
patch(loading, "load_model", lambda *args, **kwargs: load(*args, **kwargs).replace(tokenizer=tokenizer))
spec_generate = spec_jax.generate
def recorded(target, prompts, **options):
    with log.open("a") as f:
        f.write(json.dumps(prompts) + "\\n")
    return spec_generate(target, prompts, **options)
patch(spec_jax, "generate", recorded)
"""


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """The tokenizer CHAT_RUN gives the models: BOS <|endoftext|>, added to plain text."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import tiny_gguf

    from models.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp("chat") / "tiny.gguf"
    tiny_gguf.write(path, chat_template=CHAT_TEMPLATE, add_bos=True)
    return Tokenizer.from_gguf(path)


def _chat_run(files, name):
    """(result, the token prompts spec_jax.generate received, by call) of runs(...)[name]."""
    result = generate_run(files, name)
    assert result.returncode == 0, result.stderr
    log = files["folder"] / f"{name}.log"
    return result, [json.loads(line) for line in log.read_text().splitlines()]


@in_one_process
def test_chat_renders_each_prompt_with_the_targets_template_and_greedy_speculative_is_autoregressive(
    case_files, chat_tokenizer
):
    """--chat: the prompt becomes one user message in the target's template, tokenized with one
    BOS (the template's); speculative and autoregressive outputs are identical at temperature 0."""
    out = case_files["folder"] / "chat.json"
    result, calls = _chat_run(case_files, "chat")
    messages = [{"role": "user", "content": "ab"}]
    rendered = "<|endoftext|>user: ab<|im_end|>\nassistant:"
    expected = chat_tokenizer.encode_chat(messages)
    bos, end = chat_tokenizer.bos_id, chat_tokenizer.token_to_id("<|im_end|>")
    assert expected[0] == bos and expected.count(bos) == 1 and end in expected
    assert calls and all(call == [expected] for call in calls)  # warm-up and timed runs, both modes
    report = json.loads(out.read_text())
    assert report["identical_to_autoregressive"] is True
    [output] = report["outputs"]
    assert output["prompt"] == rendered and output["messages"] == messages
    assert "--- chat: 'ab'" in result.stdout


@in_one_process
def test_a_messages_line_is_rendered_with_the_template_without_chat(case_files, chat_tokenizer):
    """A {"messages": [...]} line is a conversation beside plain {"prompt": ...} lines."""
    _, calls = _chat_run(case_files, "messages")
    messages = MESSAGES
    assert calls == [[chat_tokenizer.encode("ab"), chat_tokenizer.encode_chat(messages)]]
    assert chat_tokenizer.encode("ab")[0] == chat_tokenizer.bos_id  # plain text: the tokenizer's BOS


@pytest.mark.parametrize(
    "name, message",
    [
        (
            "bad_entry",
            '--prompts_file line 2: messages[0] must be {"role": string, "content": string} and '
            "nothing else, got {'role': 'user'}",
        ),
        ("empty", "--prompts_file line 2: messages must be a non-empty list"),
        ("both", '--prompts_file line 2: has both "prompt" and "messages"'),
        (
            "no_template",
            'the "messages" of --prompts_file line 2: --target=random: the model has no chat template',
        ),
        ("chat_no_template", "--chat: --target=random: the model has no chat template (random models"),
    ],
)
@in_one_process
def test_bad_chat_input_exits_2_with_one_line(case_files, name, message):
    chat = ["--chat"] if name == "chat_no_template" else []
    result = generate_case(case_files, f"--prompts_file={case_files[name]}", *chat)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    [error] = result.stderr.strip().splitlines()
    assert error.startswith("generate.py: error: " + message)
