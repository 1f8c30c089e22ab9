"""Helpers shared by the model-based experiments and benchmark suites. The models they load by
name (the tiny random ones of the quick modes, the loader and its cache) are training.targets',
named here too: launch.train loads the same without importing the experiments."""

import ast

import numpy as np

from models import corpora, settings
from training.targets import TINY_MODELS as TINY_MODELS
from training.targets import check_model_name as check_model_name
from training.targets import encode_all as encode_all
from training.targets import load_model as load_model
from training.targets import model_names as model_names

# Code and English prompts, alternating (the Qwen pair are code models; English is harder for
# the draft), so that a few repeats already mix both. Each is at most 16 tokens with the Qwen
# tokenizer, so every prompt and every batch of them shares one compiled bucket. The decode,
# peer and roofline benchmarks use them; nothing is tuned to them.
BENCH_PROMPTS = (
    "def quicksort(arr):\n    ",
    "The history of the Roman Empire begins",
    "import numpy as np\n\ndef moving_average(x, window):\n    ",
    "To make a cup of tea, first",
    "class LinkedList:\n    def __init__(self):\n        ",
    "SELECT name, COUNT(*) FROM orders",
    "# Sum the second column of a CSV file\nimport csv\n",
    "def is_prime(n: int) -> bool:\n    ",
)

PROMPT_SETS = ("open", "grounded", "heldout")
GROUNDED_SOURCE_CHARS = 900  # the most source or article text one grounded prompt carries


def _stdlib_functions(count: int) -> list[tuple[str, str]]:
    """(source, first argument) of `count` top-level functions of 6-20 lines with an argument,
    from the held-out standard-library files (corpora's test split: no n-gram table or trimmed
    head counted them), one per file, in the split's order."""
    _, test = corpora.split(corpora.documents("code"), corpora.TRIM_TEST_FRACTION)
    found = []
    for _, text in test:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or not node.args.args or ast.get_docstring(node):
                continue
            source = ast.get_source_segment(text, node)
            if source and 6 <= source.count("\n") + 1 <= 20 and len(source) <= GROUNDED_SOURCE_CHARS:
                found.append((source, node.args.args[0].arg))
                break
        if len(found) == count:
            return found
    raise ValueError(f"num_prompts: only {len(found)} held-out stdlib functions fit, asked for {count}")


def _news_articles(count: int) -> list[str]:
    """The openings (up to GROUNDED_SOURCE_CHARS, whole lines) of `count` held-out BBC articles."""
    _, test = corpora.split(corpora.documents("news"), corpora.TRIM_TEST_FRACTION)
    texts = []
    for _, text in test[:count]:
        cut = text[:GROUNDED_SOURCE_CHARS]
        texts.append(cut[: cut.rfind("\n")].strip() if "\n" in cut else cut)
    return texts


def grounded_prompts(count: int = 8) -> list[str]:
    """Input-grounded prompts, where the output repeats the input (what prompt lookup is for),
    alternating: code editing (a held-out standard-library function and the instruction to
    rename its first argument, or to add a docstring; the rewrite is begun for the model) and
    reading (a held-out BBC News article, then a one-sentence summary or a question to answer
    by quoting it). Built from the corpora the experiments already use; no prompt's text was
    fitted into any table."""
    functions = _stdlib_functions((count + 1) // 2)
    articles = _news_articles(count // 2)
    prompts = []
    for i in range(count):
        if i % 2 == 0:
            source, arg = functions[i // 2]
            header = source.split("\n", 1)[0]
            if (i // 2) % 2 == 0:
                task = f"The same function with the argument `{arg}` renamed to `{arg}_value` everywhere:"
                start = header.replace(f"({arg}", f"({arg}_value", 1)
            else:
                task = "The same function with a docstring added:"
                start = header
            prompts.append(f"# Original:\n{source}\n\n# {task}\n{start}\n")
        else:
            article = articles[i // 2]
            if (i // 2) % 2 == 0:
                ask = "Summarize the article above in one sentence, reusing its words.\nSummary:"
            else:
                ask = "Question: What happened, according to the article above? Quote it.\nAnswer:"
            prompts.append(f"Article:\n{article}\n\n{ask}")
    return prompts


HELDOUT_PROMPTS = 8  # the size of the held-out set: checks of figures measured on the bench prompts


def heldout_prompts(count: int = HELDOUT_PROMPTS) -> list[str]:
    """Open-ended prompts of the bench prompts' kind that nothing was tuned on, alternating: the
    header of a held-out standard-library function (its `def` line and the body's indent) and
    the opening line of a held-out BBC News article (its title and first sentence). Taken from
    the END of the corpora's test split (the grounded prompts take from its start), so the three
    sets are disjoint; no n-gram table or trimmed head counted their text."""
    functions, articles = [], []
    _, code = corpora.split(corpora.documents("code"), corpora.TRIM_TEST_FRACTION)
    for _, text in reversed(code):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        header = next(
            (
                ast.get_source_segment(text, n).split("\n", 1)[0]
                for n in tree.body
                if isinstance(n, ast.FunctionDef) and n.args.args and len(n.body) > 2
            ),
            None,
        )
        if header and header.endswith(":") and len(header) <= 80:
            functions.append(header + "\n    ")
        if len(functions) == (count + 1) // 2:
            break
    _, news = corpora.split(corpora.documents("news"), corpora.TRIM_TEST_FRACTION)
    for _, text in reversed(news):
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if len(lines) >= 2:
            sentence = lines[1].split(". ")[0]
            articles.append(f"{lines[0]}\n\n{sentence}")
        if len(articles) == count // 2:
            break
    if len(functions) < (count + 1) // 2 or len(articles) < count // 2:
        raise ValueError(f"num_prompts: the held-out split holds fewer than {count} prompts")
    return [functions[i // 2] if i % 2 == 0 else articles[i // 2] for i in range(count)]


def prompt_set(name: str, count: int) -> list[str]:
    """The first `count` prompts of a set: "open" (BENCH_PROMPTS, open-ended) or "grounded"
    (grounded_prompts). ValueError("prompt_set: ...") for another name."""
    if name == "open":
        return list(BENCH_PROMPTS[:count])
    if name == "grounded":
        return grounded_prompts(count)
    if name == "heldout":
        return heldout_prompts(count)
    raise ValueError(f"prompt_set: must be one of {', '.join(PROMPT_SETS)}, got {name!r}")


def check_tuple(config, key: str, kind: type, low, high) -> None:
    """ValueError("<key>: ...") unless config[key] is a non-empty tuple of kind (int: integers,
    not bools; float: any real number) in [low, high]."""
    values = tuple(config[key])

    def ok(v):
        return (settings.is_int(v) if kind is int else settings.is_number(v)) and low <= v <= high

    if not values or not all(ok(v) for v in values):
        noun = "an integer" if kind is int else "a number"
        raise ValueError(f"{key}: each value must be {noun} in [{low:g}, {high:g}], got {values}")


def bootstrap_ratio_ci(numerators, denominators, resamples: int, seed: int, level: float = 0.95):
    """Percentile bootstrap interval over units (prompts) for sum(numerators) / sum(denominators).

    Units are resampled with replacement, `resamples` times; returns (low, high).
    """
    num = np.asarray(numerators, np.float64)
    den = np.asarray(denominators, np.float64)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, num.size, (resamples, num.size))
    ratios = num[idx].sum(1) / np.maximum(den[idx].sum(1), 1e-300)
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return float(low), float(high)
