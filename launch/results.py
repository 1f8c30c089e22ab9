"""The one results writer of the project: what a run returns (Result) and its files with their
provenance, for the experiments (experiments.framework.run_experiment) and training's command
line (launch.train).

Each run writes, into one directory (default experiments/results/):
  NAME.csv   the data: a header row, then one row per result; nothing else, so any CSV reader
             takes it as is.
  NAME.json  the sidecar: provenance (command line, git revision, machine), the config, and
             the run's summary numbers. The CSV's provenance lives here.
  NAME.md    the same provenance as a header, then the run's own tables and reading.
  NAME.png   the plot, for runs that draw one.
All files are first written to temporary names in the same directory and only renamed into
place once every one of them is complete, so a failure leaves no half-written output.
"""

import contextlib
import csv
import dataclasses
import datetime
import io
import json
import os
import platform
import resource
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

import flax
import jax
import jaxlib
import numpy as np

from models import machine, registry

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO_ROOT, "experiments", "results")


@dataclasses.dataclass
class Result:
    """What an experiment's run(config) returns (and launch.train makes of a training run's
    report); write_results turns it into files.

    columns/rows: the CSV (rows are sequences in column order). markdown: the body of the
    .md after the provenance header. summary: JSON-able key numbers, stored in the sidecar.
    figure: a matplotlib Figure saved as NAME.png, or None. passed: the experiment's own
    check (e.g. "every cell reproduced"), or None if it has none.
    """

    columns: Sequence[str]
    rows: Sequence[Sequence[Any]]
    markdown: str
    summary: dict
    figure: Any = None
    passed: bool | None = None

    @classmethod
    def from_dicts(cls, rows: Sequence[dict], *, markdown: str = "", sections=None, summary=None, **kwargs):
        """A Result whose CSV is `rows` (dicts; the columns are their keys in first-seen order)
        and whose Markdown is the rows as a table (see dict_table), then `markdown`, then one
        titled table per entry of `sections` ({title: list of dicts}); the sections are also
        stored in the summary (the JSON sidecar) under "sections"."""
        columns = list(dict.fromkeys(k for r in rows for k in r))
        body = [dict_table(rows)]
        if markdown:
            body.append(markdown.rstrip())
        sections = {title: table for title, table in (sections or {}).items() if table}
        body += [f"## {title}\n\n{dict_table(table)}" for title, table in sections.items()]
        summary = dict(summary or {})
        if sections:
            summary["sections"] = sections
        return cls(
            columns=columns,
            rows=[[r.get(k, "") for k in columns] for r in rows],
            markdown="\n\n".join(body),
            summary=summary,
            **kwargs,
        )

    @classmethod
    def from_report(cls, report):
        """A Result of a training run's report (training.report.Report, the same fields as
        from_dicts' arguments), its plot drawn on a new figure (new_figure)."""
        figure = None
        if report.plot is not None:
            figure, axes = new_figure(report.plot.width, report.plot.height, report.plot.columns)
            report.plot.draw(axes)
        return cls.from_dicts(
            report.rows,
            markdown=report.markdown,
            sections=report.sections,
            summary=report.summary,
            figure=figure,
        )


def new_figure(width: float, height: float, columns: int = 1):
    """(Figure, [axes]) for a Result's plot: a matplotlib Figure not tied to any GUI backend
    (saved by the framework as NAME.png), with `columns` axes side by side."""
    # Late: matplotlib is an optional dependency (the experiments extra; launch.train imports this
    # module without it) and costs 0.5 s of start-up after jax (measured), paid only for a figure.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, list(fig.subplots(1, columns, squeeze=False)[0])


def git_revision(repo_root: str = REPO_ROOT) -> tuple[str, bool | None]:
    """(commit hash of HEAD or "unknown", whether tracked files differ from it or None)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo_root, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return "unknown", None
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repo_root,
            capture_output=True,
            text=True,
            timeout=30,
        )
        dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
        return head.stdout.strip(), dirty
    except (OSError, subprocess.SubprocessError):
        return "unknown", None


def machine_description() -> dict:
    """Platform, CPU model and count, memory, Python, jax/jaxlib/flax/numpy versions, backend
    and devices."""
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": machine.cpu_model() or None,
        "cpu_count": os.cpu_count(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "numpy": np.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
    }


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def provenance(command: str) -> dict:
    """The provenance block every output carries: command, git revision, machine, date."""
    revision, dirty = git_revision()
    return {
        "command": command,
        "git_revision": revision,
        "git_dirty": dirty,
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine_description(),
    }


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table; cells are written with str()."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def format_cell(v) -> str:
    """Three significant digits below 1, two decimals below 1000, whole numbers above; text
    escaped so that it stays in one table cell."""
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1 else f"{v:.2f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace("|", "\\|")


def dict_table(rows: Sequence[dict]) -> str:
    """A Markdown table of dict rows; a column `x` with siblings `x_min` and `x_max` prints as
    one column `x [min, max]`."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    ranged = {k for k in keys if f"{k}_min" in keys and f"{k}_max" in keys}
    shown = [k for k in keys if not any(k in (f"{r}_min", f"{r}_max") for r in ranged)]

    def cell(row, k):
        if k not in row:
            return ""
        if k in ranged and f"{k}_min" in row:
            return f"{format_cell(row[k])} [{format_cell(row[f'{k}_min'])}, {format_cell(row[f'{k}_max'])}]"
        return format_cell(row[k])

    header = [f"{k} [min, max]" if k in ranged else k for k in shown]
    return markdown_table(header, [[cell(r, k) for k in shown] for r in rows])


def _csv_cell(value):
    if hasattr(value, "item"):  # NumPy scalars
        value = value.item()
    return repr(value) if isinstance(value, float) else value


def _csv_text(columns, rows) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"a CSV row has {len(row)} cells for {len(columns)} columns")
        writer.writerow([_csv_cell(v) for v in row])
    return buffer.getvalue()


def _markdown_text(name, title, prov, config, seconds, result, has_plot) -> str:
    m = prov["machine"]
    dirty = {True: " (with uncommitted changes)", False: "", None: ""}[prov["git_dirty"]]
    settings = ", ".join(f"{k}={v}" for k, v in sorted(config.to_dict().items()))
    header = [
        f"# {name}: {title}",
        "",
        f"- command: `{prov['command']}`",
        f"- git revision: `{prov['git_revision']}`{dirty}",
        f"- machine: {m['platform']}, {m['cpu_model']}, {m['cpu_count']} CPUs; Python {m['python']}",
        f"- jax {m['jax']} (jaxlib {m['jaxlib']}), backend {m['backend']}, devices: {', '.join(m['devices'])}",
        f"- memory {m['memory_gb']} GB; peak RSS of this run {prov['peak_rss_mb']:.0f} MiB",
        f"- date (UTC): {prov['date_utc']}; wall time {seconds:.1f} s",
        f"- config: {settings}",
        f"- files: `{name}.csv` (data), `{name}.json` (provenance, config, summary)"
        + (f", `{name}.png` (plot)" if has_plot else ""),
        "",
    ]
    body = result.markdown.rstrip() + "\n"
    if has_plot:
        body += f"\n![{name}]({name}.png)\n"
    return "\n".join(header) + "\n" + body


def write_files_atomic(directory: str, writers: dict[str, Callable[[str], None]]) -> dict[str, str]:
    """Calls writers[filename](temporary path) for each file, then renames all into directory
    (models.registry.atomic_path, one per file).

    Nothing is renamed until every writer has succeeded; on failure the temporaries are
    removed and earlier outputs stay as they were. Returns {filename: final path}.
    """
    paths = {filename: os.path.join(directory, filename) for filename in writers}
    with contextlib.ExitStack() as stack:
        temporaries = {name: stack.enter_context(registry.atomic_path(paths[name])) for name in writers}
        for filename, write in writers.items():
            write(str(temporaries[filename]))
    return paths


def _text_writer(text: str) -> Callable[[str], None]:
    def write(path):
        with open(path, "w") as f:
            f.write(text)

    return write


def prepare_output_dir(output_dir: str | None) -> str:
    """The absolute output directory (default experiments/results/), created if missing.

    Raises ValueError("output_dir: ...") if it cannot be created or written.
    """
    directory = os.path.abspath(output_dir or RESULTS_DIR)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise ValueError(f"output_dir: cannot create {directory} ({e.strerror})") from None
    if not os.access(directory, os.W_OK):
        raise ValueError(f"output_dir: {directory} is not writable")
    return directory


def write_results(
    directory: str, name: str, title: str, result: Result, *, config, prov: dict, seconds: float, quick: bool
) -> dict[str, str]:
    """Writes run `name`'s NAME.csv, .json, .md (and .png where result has a figure) into
    directory (prepare_output_dir's), atomically (write_files_atomic); returns {filename: path}.
    prov is provenance()'s block (this process's peak RSS is added), seconds the run's wall
    time, config its ml_collections config."""
    prov = {**prov, "peak_rss_mb": round(peak_rss_mb())}
    has_plot = result.figure is not None
    sidecar = {
        "experiment": name,
        "title": title,
        "quick": quick,
        "provenance": prov,
        "wall_seconds": seconds,
        "config": config.to_dict(),
        "passed": result.passed,
        "summary": result.summary,
        "columns": list(result.columns),
    }
    writers = {
        f"{name}.csv": _text_writer(_csv_text(result.columns, result.rows)),
        f"{name}.json": _text_writer(json.dumps(sidecar, indent=2, default=_json_default) + "\n"),
        f"{name}.md": _text_writer(_markdown_text(name, title, prov, config, seconds, result, has_plot)),
    }
    if has_plot:
        writers[f"{name}.png"] = lambda path: result.figure.savefig(path, format="png", dpi=120)
    return write_files_atomic(directory, writers)


def _json_default(value):
    if hasattr(value, "tolist"):  # NumPy arrays and scalars
        return value.tolist()
    if isinstance(value, tuple | set):
        return list(value)
    raise TypeError(f"not JSON-serializable: {type(value).__name__}")
