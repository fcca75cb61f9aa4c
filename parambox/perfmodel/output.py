"""How a prediction is shown: a rich table on stdout and a speedup plot (PNG)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from parambox.perfmodel.scaling import ScalingCurve


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def curves_table(curves: list[ScalingCurve], title: str) -> Table:
    """Rows: worker counts with T_comp; per topology "speedup x (efficiency)"; a last row with n_peak."""
    table = Table(title=title, title_justify="left")
    table.add_column("n", justify="right")
    table.add_column("T_comp ms", justify="right")
    for c in curves:
        table.add_column(f"{c.topology}\nspeedup (eff.)", justify="right")
    for i, n in enumerate(curves[0].n):
        t = curves[0].t_comp_s[i]
        row = [str(n), _fmt(None if t is None else t * 1e3, ".1f")]
        for c in curves:
            s, e = c.speedup[i], c.efficiency[i]
            row.append("-" if s is None else f"{s:.3g}x ({e:.0%})")
        table.add_row(*row)
    peak = ["n_peak", ""]
    for c in curves:
        peak.append(f"{c.n_peak}" + (" (growing)" if c.still_growing else ""))
    table.add_row(*peak, style="bold")
    table.add_row("n @ eff>=50%", "", *[str(c.n_efficient or "-") for c in curves])
    return table


def setups_table(result: dict) -> Table:
    """parambox's setups ranked on ``result["setups"]["nodes"]`` nodes (``perfmodel/ranking.py``)."""
    s, net = result["setups"], result["network"]
    w = s.get("workers_per_node", 1)
    each = f" of {w} workers" if w > 1 else ""
    table = Table(
        title=f"setups on {s['nodes']} nodes{each} at {net['bandwidth_gbps']:.3g} Gbit/s ({s['scaling']} scaling, "
        "simulated): samples per second, not time to a target (pick measures convergence)",
        title_justify="left",
    )
    for h in ("#", "setup", "samples/s", "vs fastest", "step ms", "comm ms", "of ceiling"):
        table.add_column(h, justify="left" if h == "setup" else "right")
    for r in s["ranking"]:
        table.add_row(
            str(r["rank"]),
            r["setup"],
            f"{r['samples_per_s']:.4g}",
            f"{r['vs_fastest']:.2f}",
            f"{r['step_ms']:.1f}",
            f"{r['comm_ms']:.1f}",
            f"{r['of_ceiling']:.0%}",
        )
    return table


def print_report(result: dict, curves: dict[str, list[ScalingCurve]], console: Console | None = None) -> None:
    if console is None:
        console = Console()
        if not console.is_terminal:  # piped: rich would wrap the table at 80 columns
            console = Console(width=120)
    net = result["network"]
    console.print(
        f"[bold]{result['model']}[/bold]: {result['parameters']:,} parameters, S = "
        f"{result['message_bytes'] / 1e6:.1f} MB; BW {net['bandwidth_gbps']:.3g} Gbit/s ({net['source']}), "
        f"latency {net['latency_us']:.3g} us, {net['servers']} servers, box {net['box_bandwidth_gbps']:.3g} "
        f"Gbit/s; overlap {result['overlap']:.0%}; T_comp {result['compute']['source']}"
    )
    for scaling, cs in curves.items():
        batch = result[scaling]["batch"]
        what = f"global batch {batch}" if scaling == "strong" else f"{batch} samples per worker"
        console.print(curves_table(cs, f"{scaling} scaling, {what}"))
    if "setups" in result:
        console.print(setups_table(result))
    if "validation" in result:
        v = result["validation"]
        rows = ", ".join(
            f"n={n}: measured {v['measured_step_ms'][n]:.1f} ms, predicted {v['predicted_step_ms'][n]:.1f} ms"
            for n in v["measured_step_ms"]
        )
        console.print(
            f"validation (ring, loopback {v['validation_bandwidth_gbps']:.2f} Gbit/s, batch "
            f"{v['global_batch']}): {rows}; max relative error {v['max_rel_error']:.1%}"
        )


def plot_speedup(
    curves: dict[str, list[ScalingCurve]], batches: dict[str, int], title: str, path: Path
) -> None:
    """Speedup vs n on log2 axes, one line per topology, the ideal line dashed, each n_peak marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")  # 1, 2, 4, ..., 1024 and 0.25 rather than 2^k

    fig, axes = plt.subplots(1, len(curves), figsize=(6.5 * len(curves), 4.8), squeeze=False)
    for ax, (scaling, cs) in zip(axes[0], curves.items()):
        ns = cs[0].n
        ax.plot(ns, ns, "k--", lw=1, label="ideal (speedup = n)")
        for c in cs:
            pts = [(n, s) for n, s in zip(c.n, c.speedup) if s is not None]
            line = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=c.topology)[0]
            peak = dict(pts)[c.n_peak]
            ax.plot([c.n_peak], [peak], marker="*", ms=12, color=line.get_color(), ls="none")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.xaxis.set_major_formatter(plain)
        ax.yaxis.set_major_formatter(plain)
        ax.set_xlabel("workers n")
        ax.set_ylabel("speedup over one worker (x)" if scaling == "strong" else "scaled speedup (x)")
        what = f"global batch {batches[scaling]}" if scaling == "strong" else f"{batches[scaling]} per worker"
        ax.set_title(f"{scaling} scaling, {what} (star: n_peak)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
