"""What a training run reports (Report): its table, its reading, its summary numbers and its
plot, as data; launch.results writes them (Result.from_report) as NAME.csv/.md/.json/.png. The
plot is a function that draws on axes it is given, so that training never imports matplotlib
(an optional dependency)."""

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Plot:
    """A figure of `columns` axes side by side, width x height inches; draw(axes) draws on them."""

    width: float
    height: float
    columns: int
    draw: Callable[[list], None]


@dataclasses.dataclass
class Report:
    """A training run's outcome: rows (dicts, the CSV and the Markdown table), markdown (the
    reading after the table), sections ({title: list of dicts}, more tables), summary (JSON-able
    numbers for the sidecar) and plot (None: no figure)."""

    rows: list[dict]
    markdown: str
    summary: dict
    sections: dict = dataclasses.field(default_factory=dict)
    plot: Plot | None = None
