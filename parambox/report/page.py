"""The report page: figures written into REPORT_DIR plus ``index.md`` (and ``index.html``) with the table."""

from __future__ import annotations

import html
import re
from pathlib import Path

from parambox.errors import UserError
from parambox.numerics import is_finite
from parambox.report import plots
from parambox.report.runs import Run

COLUMNS = [
    "run",
    "strategy",
    "workers",
    "model",
    "data",
    "steps",
    "final test {metric}",
    "final test loss",
    "wall time (s)",
    "samples/s",
]


def _num(x, spec: str) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not is_finite(x):
        return str(x)  # a diverged run: nan / inf, shown as such
    return format(x, spec)


def summary_rows(runs: list[Run]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the summary table: one row per run, a column per communication phase (mean ms/step)."""
    phases = list(dict.fromkeys(ph for r in runs for ph in r.comm_phases()))
    lost = any(r.summary.get("lost_workers") for r in runs)
    metric = common_metric(runs)
    columns = [c.format(metric=metric + (" (%)" if metric == "accuracy" else "")) for c in COLUMNS]
    header = columns + [f"comm {ph} (ms/step)" for ph in phases] + (["lost workers"] if lost else [])
    rows = []
    for r in runs:
        acc = r.final(f"test_{r.target_metric}")
        if acc is not None and r.target_metric == "accuracy" and acc <= 1.0:
            acc *= 100
        row = [r.label, r.info("strategy") or "-", _num(r.info("workers"), "d"), r.info("model") or "-"]
        row += [r.info("data") or "-", _num(r.info("steps"), "d"), _num(acc, ".2f")]
        row += [_num(r.final("test_loss"), ".4f"), _num(r.info("wall_time_s"), ".1f")]
        row += [_num(r.info("samples_per_s"), ",.0f")]
        means = r.mean_comm_ms()
        row += [_num(means.get(ph), ".2f") for ph in phases]
        if lost:
            row.append(", ".join(str(w) for w in r.summary.get("lost_workers") or []) or "-")
        rows.append([str(c) for c in row])
    return header, rows


def common_metric(runs: list[Run]) -> str:
    """The runs' target metric (``target_metric``), or "metric" where they aim at different ones."""
    names = {r.target_metric for r in runs}
    return names.pop() if len(names) == 1 else "metric"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    def cell(s: str) -> str:
        return s.replace("|", "\\|")

    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "run"


def write_figures(runs: list[Run], out: Path, smoothing: float = 0.0) -> list[tuple[str, Path]]:
    """Write the standard figures; returns (caption, path) for the ones that had data."""
    made = [
        (
            "Training loss",
            plots.figure_pair(runs, "loss", "step", "training loss", out / "loss.png", smoothing),
        ),
        (
            f"Test {common_metric(runs)}",
            plots.figure_pair(
                runs,
                f"test_{common_metric(runs)}",
                "eval",
                f"test {common_metric(runs)}",
                out / "accuracy.png",
            ),
        ),
        ("Test loss", plots.figure_pair(runs, "test_loss", "eval", "test loss", out / "test_loss.png")),
        ("Throughput", plots.figure_throughput(runs, out / "throughput.png")),
        ("Communication time per phase", plots.figure_comm_bars(runs, out / "comm.png")),
    ]
    used: set[str] = set()
    for r in runs:
        slug = _slug(r.label)
        while slug in used:
            slug += "-"
        used.add(slug)
        made.append(
            (f"Communication per step: {r.label}", plots.figure_comm_steps(r, out / f"comm_{slug}.png"))
        )
    return [(caption, path) for caption, path in made if path is not None]


def write_report(
    runs: list[Run], out: str | Path, title: str = "parambox report", smoothing: float = 0.0
) -> Path:
    """Figures, ``index.md`` and ``index.html`` in ``out``; returns the path of index.md."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create the report directory ({e.strerror})") from None
    figures = write_figures(runs, out, smoothing)
    header, rows = summary_rows(runs)
    sources = "\n".join(f"- `{r.label}`: `{r.path}`" for r in runs)
    md = [
        f"# {title}",
        "",
        f"{len(runs)} run(s).",
        "",
        "## Runs",
        "",
        markdown_table(header, rows),
        "",
        sources,
        "",
    ]
    for caption, path in figures:
        md += [f"## {caption}", "", f"![{caption}]({path.name})", ""]
    (out / "index.md").write_text("\n".join(md))
    (out / "index.html").write_text(html_page(title, header, rows, figures))
    return out / "index.md"


def html_page(
    title: str,
    header: list[str],
    rows: list[list[str]],
    figures: list[tuple[str, Path]],
    base: Path | None = None,
    tables: list[tuple[str, list[str], list[list[str]]]] = (),
) -> str:
    """A self-contained page: the title, one table, further (caption, header, rows) ``tables`` and
    each (caption, figure); figure paths are written relative to ``base`` (the page's folder), or
    as bare names when ``base`` is None."""
    e = html.escape

    def table(header: list[str], rows: list[list[str]]) -> str:
        head = "".join(f"<th>{e(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows)
        return f"<table><tr>{head}</tr>{body}</table>"

    more = "".join(f"<h2>{e(caption)}</h2>{table(h, r)}" for caption, h, r in tables)

    def src(p: Path) -> str:
        return str(p.relative_to(base)) if base is not None else p.name

    imgs = "".join(f'<h2>{e(c)}</h2><img src="{e(src(p))}" alt="{e(c)}">' for c, p in figures)
    style = "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px}img{max-width:100%}"
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title><style>{style}</style>"
        f"</head><body><h1>{e(title)}</h1>{table(header, rows)}{more}{imgs}</body></html>\n"
    )
