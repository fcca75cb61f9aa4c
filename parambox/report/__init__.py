"""Plots and tables from run directories (``parambox report RUN_DIR... --out REPORT_DIR``).

Library use (sweeps and studies build on it)::

    from parambox.report import load_runs, write_report
    runs = load_runs(["runs/allreduce-2", "runs/box-sync-2"])
    write_report(runs, "report/")            # loss.png, accuracy.png, ..., index.md, index.html
"""

from __future__ import annotations

from parambox.report.page import summary_rows, write_figures, write_report
from parambox.report.plots import plot_comm_bars, plot_comm_steps, plot_runs, save_figure, smooth
from parambox.report.runs import Run, load_run, load_runs

__all__ = [
    "Run",
    "load_run",
    "load_runs",
    "plot_comm_bars",
    "plot_comm_steps",
    "plot_runs",
    "save_figure",
    "smooth",
    "summary_rows",
    "write_figures",
    "write_report",
]
