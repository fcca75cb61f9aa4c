"""``parambox reproduce --out DIR [--quick] [--only ID,...]``: re-measure every quantitative claim of the
seeds at a size this machine takes and judge it: DIR/claims.json and DIR/index.html.

Claims (ids for ``--only``): neuron (SHM-Learn-Dist §3, Fig. 2.1), grid (§5, Table 5.1), phases (§6,
Figs. 6.4-6.6), gain (§6, Fig. 6.3), hybrid (ShmCaffe-H against ShmCaffe), easgd-tau (the EASGD
paper's tau in 1, 4, 16, 64), smb (Soft Memory Box against MPI), lerat (local parallelism on a CPU),
keuper (data parallelism is communication bound; on the emulated cluster, needs root). Each entry of
claims.json holds the claim, its source, the command that measured it, the figures measured, the
verdict (reproduced, partly, not reproduced; skipped with a reason) and its plot. Running it again
with the same --out reuses the finished training runs. ``--quick``: tiny measurements, for tests.
See ``parambox.studies.reproduce`` for each verdict's rule.

The time-to-target claim (tau-h: local steps between exchanges against the time to a target) runs on
another workload with ``--model``/``--data`` (and ``--lr``; SGD, as the methods compared), to a target in its metric's
own units: ``--target perplexity=12`` (lower is better: perplexity, bits_per_byte, a loss), ``--target
accuracy=0.9``, or ``--target METRIC<=VALUE`` for a metric of your own that falls.

    parambox reproduce --out repro
    parambox reproduce --out repro-gpt --only tau-h --model gpt --data text --target perplexity=15
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def configure(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--out", type=Path, required=True, help="output directory (rerun to resume)")
    p.add_argument("--quick", action="store_true", help="tiny measurements: checks the machinery only")
    p.add_argument("--only", help="comma list of claim ids (default: all nine)")
    tta = p.add_argument_group("the time-to-target claim (--only tau-h)")
    tta.add_argument("--model", help="its runs' model: a zoo name or file.py:fn (default lenet)")
    tta.add_argument("--data", help="its runs' data set (default mnist; --model gpt: give --data text)")
    tta.add_argument("--data-path", help="the data set's files, as for parambox train")
    tta.add_argument("--lr", type=float, help="its runs' base learning rate (default the claim's, 0.03)")
    tta.add_argument(
        "--target",
        metavar="METRIC=VALUE",
        help="the test metric its runs reach: perplexity=12, bits_per_byte=3, accuracy=0.9 (direction known), "
        "or METRIC<=VALUE / METRIC>=VALUE (default accuracy=0.98; needed with --model/--data)",
    )


def run(args: argparse.Namespace) -> int:
    from parambox.studies.reproduce import run_reproduce, table_rows
    from parambox.workload import refs
    from parambox.workload.targets import Target

    t0 = time.perf_counter()
    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    workload = {k: getattr(args, k) for k in ("model", "data", "data_path", "lr")}
    for key in ("model", "data"):  # a file.py:fn made absolute: the runs start in their own directories
        if workload[key] is not None and refs.is_reference(workload[key]):
            workload[key] = refs.absolute(workload[key])
    target = Target.parse(args.target) if args.target is not None else None
    result = run_reproduce(args.out, quick=args.quick, only=only, workload=workload, target=target)
    for row in table_rows(result)[1]:
        print(f"{row[2]:>15}  {row[0]}\n{'':>17}{row[3]}")
    print(
        f"reproduce took {time.perf_counter() - t0:.0f} s; {args.out / 'claims.json'}, {args.out / 'index.html'}"
    )
    return 0
