"""The README names only what exists (issue 54): every repo path it names (links, paths in
inline code, `python -m` modules), every heading a link points into, and every module of its
Layout section; the layout names every top-level package; the README stays under 600 words.

A Layout bullet reads "- `package/`: what it is. `module`, `module` (...), `sub/`": the first
code span is a top-level folder, every later code span an entry of it (a module `name` is
`name.py` or a package `name/`; `name/` a folder; `name.ext` a file). Nothing else in that
section is in backticks, so a renamed or moved module shows here as missing.
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_WORDS = 600
# The top-level folders the layout must name: every Python package, and these.
TOP_LEVEL_FOLDERS = ("scripts", "tests", "docs")

_FENCE = re.compile(r"```.*?```", re.S)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_CODE = re.compile(r"`([^`\n]+)`")
_PATH_LIKE = re.compile(r"^[\w.\-]+(/[\w.\-]+)*/?$")
_MODULE_RUN = re.compile(r"python -m ([\w.]+)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _without_code_blocks(text: str) -> str:
    return _FENCE.sub("", text)


def split_layout(text: str) -> tuple[str, str]:
    """(the README without its Layout section, the Layout section's text)."""
    match = re.search(r"^## Layout[^\n]*\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    if match is None:
        return text, ""
    return text[: match.start()] + text[match.end() :], match.group(1)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    words = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return words.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading anchor of a markdown file (headings in code blocks are not headings)."""
    found, seen = set(), {}
    for line in _without_code_blocks(markdown).splitlines():
        match = _HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def _is_repo_path(span: str) -> bool:
    if "/" not in span or "://" in span or span.startswith(("~", "$", "-", "/")):
        return False
    return _PATH_LIKE.match(span) is not None


def _module_exists(root: pathlib.Path, module: str) -> bool:
    base = root.joinpath(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def missing_paths(root: pathlib.Path, text: str) -> list[str]:
    """What the README (outside its Layout section) names that is not under root."""
    body, _ = split_layout(text)
    prose = _without_code_blocks(body)
    problems = []
    for target in _LINK.findall(prose):
        if re.match(r"^[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        where = root / path if path else root / "README.md"
        if not where.exists():
            problems.append(f"link {target}: no {path}")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where.read_text()):
            problems.append(f"link {target}: no heading #{anchor} in {path or 'README.md'}")
    for span in _CODE.findall(prose):
        if _is_repo_path(span) and not (root / span).exists():
            problems.append(f"path {span}")
    for module in _MODULE_RUN.findall(text):
        if not _module_exists(root, module):
            problems.append(f"module {module} (python -m)")
    return problems


def layout_entries(text: str) -> list[tuple[str, str]]:
    """(folder, entry) for every code span of the Layout section's bullets; entry "" is the
    folder itself."""
    _, layout = split_layout(text)
    entries = []
    for bullet in re.split(r"^- ", layout, flags=re.M)[1:]:
        spans = _CODE.findall(bullet)
        if not spans:
            continue
        folder = spans[0].rstrip("/")
        entries.append((folder, ""))
        entries.extend((folder, span) for span in spans[1:])
    return entries


def _entry_exists(root: pathlib.Path, folder: str, entry: str) -> bool:
    base = root / folder
    if not entry:
        return base.is_dir()
    if entry.endswith("/"):
        return (base / entry).is_dir()
    if "." in entry:
        return (base / entry).is_file()
    return (base / f"{entry}.py").is_file() or (base / entry / "__init__.py").is_file()


def missing_layout_entries(root: pathlib.Path, text: str) -> list[str]:
    return [
        f"{folder}/{entry}"
        for folder, entry in layout_entries(text)
        if not _entry_exists(root, folder, entry)
    ]


def top_level_folders(root: pathlib.Path) -> set[str]:
    packages = {p.parent.name for p in root.glob("*/__init__.py")}
    return packages | {name for name in TOP_LEVEL_FOLDERS if (root / name).is_dir()}


def test_every_path_the_readme_names_exists():
    assert missing_paths(ROOT, README.read_text()) == []


def test_every_module_in_the_readme_layout_exists():
    text = README.read_text()
    entries = layout_entries(text)
    assert len(entries) >= 30, f"the Layout section parsed to only {entries}"
    assert missing_layout_entries(ROOT, text) == []


def test_the_readme_layout_names_every_top_level_package():
    named = {folder for folder, entry in layout_entries(README.read_text()) if not entry}
    assert top_level_folders(ROOT) - named == set()


def test_the_readme_is_at_most_600_words():
    words = len(README.read_text().split())  # as `wc -w` counts
    assert words <= MAX_WORDS, f"README.md has {words} words"


def _fake_repo(root: pathlib.Path) -> None:
    (root / "docs").mkdir()
    (root / "docs" / "usage.md").write_text("# Usage\n\n## Set-up and the first run\n")
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "here.py").write_text("")
    (root / "pkg" / "sub" / "__init__.py").write_text("")


def test_a_missing_path_heading_or_layout_module_is_reported(tmp_path):
    _fake_repo(tmp_path)
    readme = "\n".join(
        [
            "# x",
            "See [usage](docs/usage.md#set-up-and-the-first-run), `docs/usage.md`, `pkg/here.py`.",
            "Gone: [old](docs/old.md), [moved](docs/usage.md#models), `scripts/gone.py`.",
            "Run `python -m pkg.here` or `python -m pkg.gone`; a URL [u](https://example.com/x).",
            "",
            "## Layout",
            "",
            "- `pkg/`: a package. `here`, `sub`, `sub/`, `absent`, `absent/`.",
            "- `docs/`: `usage.md`, `gone.md`.",
            "- `nowhere/`: a folder that is not there.",
        ]
    )
    assert missing_paths(tmp_path, readme) == [
        "link docs/old.md: no docs/old.md",
        "link docs/usage.md#models: no heading #models in docs/usage.md",
        "path scripts/gone.py",
        "module pkg.gone (python -m)",
    ]
    assert missing_layout_entries(tmp_path, readme) == [
        "pkg/absent",
        "pkg/absent/",
        "docs/gone.md",
        "nowhere/",
    ]
    named = {folder for folder, entry in layout_entries(readme) if not entry}
    assert top_level_folders(tmp_path) - named == set()
    (tmp_path / "newpkg").mkdir()
    (tmp_path / "newpkg" / "__init__.py").write_text("")
    assert top_level_folders(tmp_path) - named == {"newpkg"}


def test_slug_matches_github_anchors():
    assert slug("A Zen 5 (2026-11-28, evening)") == "a-zen-5-2026-11-28-evening"
    assert slug("Serving: `launch.serve` against `llama-server`") == (
        "serving-launchserve-against-llama-server"
    )
    assert slug("Against what a CPU user would run instead (the README's table)") == (
        "against-what-a-cpu-user-would-run-instead-the-readmes-table"
    )
