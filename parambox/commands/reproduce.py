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

    parambox reproduce --out repro
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


def run(args: argparse.Namespace) -> int:
    from parambox.studies.reproduce import run_reproduce, table_rows

    t0 = time.perf_counter()
    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    result = run_reproduce(args.out, quick=args.quick, only=only)
    for row in table_rows(result)[1]:
        print(f"{row[2]:>15}  {row[0]}\n{'':>17}{row[3]}")
    print(
        f"reproduce took {time.perf_counter() - t0:.0f} s; {args.out / 'claims.json'}, {args.out / 'index.html'}"
    )
    return 0
