"""`wnw-report`: every table and figure of the paper from run directories (never runs a model).

    wnw-report [--runs DIR ...] [--out DIR] [--models M,...] [--stand-in ROLE=DATASET[/SPLIT[/LANG]] ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from wnw_exp.report.specs import DEFAULT_STAND_IN, ROLES, Data


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="wnw-report", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Every cell comes from a run directory; a cell without one is blank and "
                                       "listed in OUT/missing.md.")
    p.add_argument("--runs", nargs="+", action="extend", default=None, metavar="DIR",
                   help="roots to search for run directories (default: outputs/runs)")
    p.add_argument("--out", default="outputs/report", help="output directory (default: outputs/report)")
    p.add_argument("--models", default=None,
                   help="comma-separated backbone axis for every table (default: the paper's backbones of each "
                        "table plus every other model found, as a stand-in)")
    p.add_argument("--stand-in", action="append", default=[], metavar="ROLE=DATASET[/SPLIT[/LANG]]",
                   help="data set a stand-in model (one not in the paper) is evaluated on for a paper role "
                        f"({', '.join(ROLES)}); default: "
                        + ", ".join(f"{k}={v}" for k, v in DEFAULT_STAND_IN.items()))
    p.add_argument("--conf", default=None, help="the conf/ folder whose method defaults tell main-table runs "
                                                "from ablation runs (default: the one wnw-exp ships, or $WNW_CONF)")
    p.add_argument("--figure4-sample", default=None, help="sample id for Figure 4 (default: the longest one "
                                                          "every run decoded)")
    p.add_argument("--no-figures", action="store_true", help="tables and CSV only")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from wnw_exp.report.build import DEFAULT_CONF, build_report

    stand_in = dict(DEFAULT_STAND_IN)
    for item in args.stand_in:
        role, sep, data = item.partition("=")
        if not sep or role not in ROLES:
            print(f"wnw-report: --stand-in {item!r}: expected ROLE=DATASET[/SPLIT[/LANG]], ROLE one of "
                  f"{', '.join(ROLES)}", file=sys.stderr)
            return 2
        if data in ("", "none"):
            stand_in.pop(role, None)
        else:
            stand_in[role] = Data.parse(data)
    roots = args.runs or ["outputs/runs"]
    missing_roots = [r for r in roots if not Path(r).exists()]
    if missing_roots:
        print(f"wnw-report: no such directory: {', '.join(missing_roots)} (an empty report is written)",
              file=sys.stderr)
    res = build_report(roots, args.out, conf_dir=Path(args.conf) if args.conf else DEFAULT_CONF,
                       models=args.models.split(",") if args.models else None, stand_in=stand_in,
                       figure4_sample=args.figure4_sample, make_figures=not args.no_figures)
    print(f"{len(res.runs)} runs -> {res.out}/runs.csv")
    for t in res.tables:
        print(f"  {t.key:<24} {t.n_filled:>4} of {t.n_cells:<4} cells  -> tables/{t.key}.md, .tex")
    for p in res.figures:
        if p.suffix == ".png":
            print(f"  {p.relative_to(res.out)} (+ .pdf)")
    print(f"{res.missing} cells missing -> {res.out}/missing.md; all in one page: {res.out}/report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
