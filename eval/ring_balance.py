"""Work per rank of static plans under ring attention: max / mean before (diffusers' contiguous
chunks) and after (zigzag order), pure plan arithmetic (no model, no timing).

    python -m fastdit.eval.ring_balance                     # Wan 480p and HunyuanVideo 720p, 2/4/8 ranks
    python -m fastdit.eval.ring_balance --grid 21,30,52 --ranks 2,4 --json out.json

Work of a rank in one layer: the block pairs its ring steps compute
(``fastdit.methods.parallel.balance.rank_block_pairs``), over the plan's heads (the defaults share
one plan across heads). Grids are the video tokens of the published resolutions (HunyuanVideo's
text suffix left out: diffusers 0.42 has no context-parallel plan for it).
"""
from __future__ import annotations

import argparse
import json
import sys

from fastdit.layout import TokenLayout
from fastdit.methods import get_method
from fastdit.methods.parallel.balance import ORDERS, imbalance, rank_block_pairs

#: (name, family, (T, H, W) latent tokens): Wan2.1 480p x 81 frames, HunyuanVideo 720p x 129 frames.
GRIDS = (("Wan 480p", "wan", (21, 30, 52)), ("HunyuanVideo 720p", "hunyuan_video", (33, 45, 80)))


def method_plan(method, family, layout):
    """The plan a patched pipeline of ``family`` would use on ``layout`` (family and method
    defaults; radial with the reference's block size 128, see ``radial_report``)."""
    cls = get_method(method)
    options = {}
    if method == "radial":
        from fastdit.eval.bench.radial_report import REFERENCE_SETTINGS

        options = dict(REFERENCE_SETTINGS.get(family, {}))
    instance = cls(cls.resolve(cls.make_config(**options), family))
    return instance.prepare(layout, 1, "cpu")


def balance_rows(grids=GRIDS, methods=("sta", "radial"), ranks=(2, 4, 8)):
    rows = []
    for name, family, grid in grids:
        layout = TokenLayout(grid)
        for method in methods:
            plan = method_plan(method, family, layout)
            for n in ranks:
                row = {"grid": name, "tokens": layout.video_len, "method": method, "plan": plan.name,
                       "density": round(plan.density, 4), "ranks": n}
                for order in ORDERS:
                    work = rank_block_pairs(plan, layout, n, order)
                    row[f"pairs_{order}"] = work
                    row[f"max_mean_{order}"] = None if work is None else round(imbalance(work), 4)
                rows.append(row)
    return rows


def format_table(rows):
    lines = ["| grid | method (plan, density) | ranks | " + " | ".join(f"max/mean {o}" for o in ORDERS)
             + " | block pairs per rank, contiguous |", "|---|---|---|" + "---|" * len(ORDERS) + "---|"]
    for row in rows:
        ratios = " | ".join(str(row[f"max_mean_{o}"]) for o in ORDERS)
        pairs = ", ".join(map(str, row["pairs_contiguous"] or []))
        lines.append(f"| {row['grid']} ({row['tokens']} tokens) | {row['method']} ({row['plan']}, "
                     f"{row['density']:.3f}) | {row['ranks']} | {ratios} | {pairs} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fastdit.eval.ring_balance", description=__doc__.split("\n")[0])
    parser.add_argument("--grid", help="T,H,W video tokens (default: Wan 480p and HunyuanVideo 720p)")
    parser.add_argument("--family", default="wan", help="model family for the defaults with --grid")
    parser.add_argument("--ranks", default="2,4,8")
    parser.add_argument("--methods", default="sta,radial")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    grids = GRIDS
    if args.grid:
        grid = tuple(int(x) for x in args.grid.split(","))
        grids = ((f"{grid[0]}x{grid[1]}x{grid[2]}", args.family, grid),)
    rows = balance_rows(grids, tuple(args.methods.split(",")), tuple(int(n) for n in args.ranks.split(",")))
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "ring_balance", "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
