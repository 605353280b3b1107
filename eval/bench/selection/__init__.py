"""Benchmark: do the threshold-selecting methods keep the attention mass they promise?

Run ``python -m fastdit.eval.bench.selection`` (options below). For sparge (``cdf``) and svg2
(``top_p``), each method entry (``name`` or ``name:option=value:...``, as ``eval.bench.methods``
reads them; default: each method with its default estimator and with its published one,
``sparge:estimator=pooled`` and ``svg2:estimator=centroids``) runs at every threshold of the
sweep (``--thresholds``, default 0.8, 0.9, 0.95, 0.98) on one input set per head kind of
``fastdit.eval.bench.structured`` (every kind by default, old and new), every call sparse
(``dense_steps = dense_layers = 0``), through ``fastdit.attention(..., return_info="mass")``;
svg2's k-means is a cold start at an entry's first threshold and warm-started from the previous
threshold's clustering after that (``state``), as consecutive denoising steps are.

Columns per (kind, entry, threshold), every head of the kind in one call:

* ``density``: ``info["density"]`` (computed query-key pairs / dense's);
* ``kept``: ``info["kept_mass"]`` averaged over heads (the true fraction of softmax mass kept,
  mean over query rows); ``predicted``: the method's own predicted kept mass
  (``plan.info["predicted_mass"]``, same rows); ``kept - threshold`` is the promise's slack;
* ``error``: ``||out - dense|| / ||dense||`` over the video query rows, dense in float64;
* ``oracle``: the error of the best block mask at the same density, per head: the 3-D tiles of
  sparge's default tiling (``tile``, 2x8x8 for video: 128 tokens) as query and key blocks, block
  pairs chosen from their true masses (float64 dense softmax) to fit the head's density, the
  better (lower error) of two constructions: per query block the fewest key blocks by true mass
  whose share of the block's mass reaches one common level, the level the largest that fits (an
  exact-mass ``cdf``); and block pairs ranked by true mass per computed pair, kept while they fit
  (after each query block's best key block). The output under the mask is exact (renormalised
  float64 probabilities). ``ratio = error / oracle``.
  For svg2 also ``oracle_own``: the same in its own blocks (this call's query and key clusters).
* ``select_ms``: the method's selection alone (``method.select``: pooling or a cold k-means plus
  the estimator), and for svg2 ``score_ms`` (the estimator, selection and plan from given
  clusters), at the sweep's threshold nearest 0.9 only (the cost barely depends on the
  threshold), median of ``--runs`` after ``--warmup``, beside ``dense_ms`` (dense SDPA of the same
  call); on the CPU the load average is recorded (other work shares the cores).

The oracle's own curve (``--oracle-densities``) and every entry's error-vs-density curve are
plotted per kind in a PNG beside the JSON (``--json``; matplotlib). The claims (issue 23), for the
default-estimator entries at thresholds 0.9 and 0.95 on every kind: ``kept >= threshold - 0.05``
and ``error <= 2 * oracle`` (or ``error <= oracle + 0.01`` where ``oracle < 0.005``), the oracle
being the tile oracle unless its floor (one key block per query block) is above the method's
density, then svg2's own-block oracle (``claim_oracle``); ``error_claim_best`` checks the error
against the lower of the two oracles as well (the strictest reading).

``--reuse 0.9,0.95``: also the selection cost over a run of drifting steps with reuse across steps
off and at each ``reuse_threshold`` (``results["reuse"]``; ``eval/bench/selection/reuse.py``).

Default size: 4x32x32 = 4096 video tokens, 2 heads per kind, D = 64 (a CPU run of a few minutes).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

import fastdit
from fastdit.eval.bench import common
from fastdit.eval.bench.methods import build_method, make_call, parse_methods, split_top_level
from fastdit.eval.bench.structured import KINDS, structured_qkv
from fastdit.jsonutil import dump_json
from fastdit.methods.sparge import VIDEO_TILE, IMAGE_TILE
from fastdit.methods.sta import choose_tile, tile_permutation

#: The threshold option of each method this benchmark sweeps.
THRESHOLD = {"sparge": "cdf", "svg2": "top_p"}
DEFAULT_METHODS = "sparge,svg2,sparge:estimator=pooled,svg2:estimator=centroids"
CLAIM_THRESHOLDS = (0.9, 0.95)
MASS_SLACK = 0.05
ERROR_FACTOR = 2.0
SMALL_ORACLE, SMALL_SLACK = 0.005, 0.01


def dense_probs(q, k, scale):
    """float64 softmax ``(H, S, S)`` of batch element 0."""
    scores = (q[0].double() @ k[0].double().transpose(-1, -2)) * scale
    return torch.softmax(scores, dim=-1)


def tile_blocks(layout, tile=None):
    """``(block of each model token (S,), number of blocks)``: sparge's 3-D tiles (text in blocks
    of the same size after them)."""
    tile = tile or choose_tile(layout.grid, VIDEO_TILE if layout.frames > 1 else IMAGE_TILE)
    block = math.prod(tile)
    perm, n_video, n_text = tile_permutation(layout, tile, block)
    index = torch.empty(layout.seq_len, dtype=torch.long)
    slots = torch.arange(perm.numel()) // block
    index[perm[perm >= 0]] = slots[perm >= 0]
    return index, n_video + n_text


def block_mass(probs, q_index, n_q, k_index, n_k):
    """True mass ``(n_q, n_k)`` float64 of each block pair of one head, and the block sizes."""
    seq = probs.shape[0]
    by_key = torch.zeros(seq, n_k, dtype=torch.float64).index_add_(1, k_index, probs)
    mass = torch.zeros(n_q, n_k, dtype=torch.float64).index_add_(0, q_index, by_key)
    return mass, torch.bincount(q_index, minlength=n_q).double(), torch.bincount(k_index, minlength=n_k).double()


def greedy_keep(mass, sq, sk, budget):
    """Block pairs by true mass per pair while they fit ``budget`` pairs (after each query block's
    best key block)."""
    n_q, n_k = mass.shape
    pairs = sq[:, None] * sk[None]
    keep = torch.zeros(n_q, n_k, dtype=torch.bool)
    keep[torch.arange(n_q), mass.argmax(1)] = sq > 0
    value = torch.where(pairs > 0, mass / pairs.clamp_min(1.0), torch.full_like(mass, -1.0))
    value[keep] = -1.0  # already kept
    order = value.reshape(-1).argsort(descending=True)
    cum = pairs.reshape(-1)[order].cumsum(0)
    take = order[(cum <= budget - float((pairs * keep).sum())) & (value.reshape(-1)[order] >= 0)]
    keep.view(-1)[take] = True
    return keep


def level_keep(mass, sq, sk, budget, steps=40):
    """Per query block, the fewest key blocks by true mass whose share of the block's mass reaches
    one common level ``c`` (an exact-mass ``cdf``), ``c`` the largest that fits ``budget`` pairs."""
    share = mass / mass.sum(1, keepdim=True).clamp_min(1e-300)
    sorted_share, order = share.sort(dim=1, descending=True)
    before = sorted_share.cumsum(1) - sorted_share
    sizes = sk[order]

    def keep_at(level):
        rank = (before < level).sum(1, keepdim=True).clamp(min=1)
        return torch.arange(mass.shape[1])[None] < rank

    low, high = 0.0, 1.0
    for _ in range(steps):
        mid = 0.5 * (low + high)
        if float((sq[:, None] * sizes * keep_at(mid)).sum()) <= budget:
            low = mid
        else:
            high = mid
    return torch.zeros_like(share, dtype=torch.bool).scatter_(1, order, keep_at(low))


def oracle_masks(probs, q_index, n_q, k_index, n_k, density):
    """The two candidate best block masks (model order, ``(S, S)`` bool) of one head at ``density``:
    ``greedy_keep`` and ``level_keep`` (see the module docstring)."""
    seq = probs.shape[0]
    mass, sq, sk = block_mass(probs, q_index, n_q, k_index, n_k)
    budget = density * seq * seq
    return [keep[q_index][:, k_index] for keep in (greedy_keep(mass, sq, sk, budget),
                                                   level_keep(mass, sq, sk, budget))]


def masked_output(probs, v, mask):
    kept = probs * mask
    return (kept @ v) / kept.sum(-1, keepdim=True).clamp_min(1e-300)


def video_error(out, ref, rows):
    return common.rel_error(out[..., rows, :], ref[..., rows, :])


def oracle_error(probs, v, ref, rows, blocks_per_head, densities):
    """Error (video rows, all heads) and density of the better of the two oracle constructions."""
    outs, pairs = [[], []], [0.0, 0.0]
    for head, ((q_index, n_q, k_index, n_k), density) in enumerate(zip(blocks_per_head, densities)):
        for which, mask in enumerate(oracle_masks(probs[head], q_index, n_q, k_index, n_k, density)):
            pairs[which] += float(mask.sum())
            outs[which].append(masked_output(probs[head], v[head], mask))
    seq = probs.shape[-1]
    found = [(video_error(torch.stack(o), ref, rows), p / (len(o) * seq * seq)) for o, p in zip(outs, pairs)]
    return min(found)


def own_blocks(plan, head):
    """svg2's query and key clusters of one head as ``(q_index, n_q, k_index, n_k)``."""
    q_index, k_index = plan.q_blocks[0, head].cpu(), plan.k_blocks[0, head].cpu()
    return q_index, int(plan.q_offsets.shape[-1] - 1), k_index, int(plan.k_offsets.shape[-1] - 1)


def selection_ms(name, options, inputs, args):
    """Milliseconds of the method's selection: ``select_ms`` (``method.select``, a cold call: fresh
    state) and, for svg2, ``score_ms`` (``plan_from_clusters`` alone: the estimator, the selection
    and the plan, without the k-means)."""
    method = build_method(name, options)
    ctx, _ = make_call(method, inputs.layout, inputs.q, inputs.k, inputs.v, backend=args.backend)
    ctx.info = {}
    q, k = inputs.q, inputs.k

    def select():
        ctx.state.clear()
        return method.select(ctx, q, k)

    times = {"select_ms": common.time_fn(select, args.runs, args.warmup, False)}
    if hasattr(method, "plan_from_clusters"):
        clusters = method.cluster(ctx, q, k)
        times["score_ms"] = common.time_fn(lambda: method.plan_from_clusters(ctx, clusters, q, k), args.runs,
                                           args.warmup, False)
    return times


class Reference:
    """Dense float64 reference of one input set (batch element 0): softmax ``probs`` ``(H, S, S)``,
    ``v64``, the dense output ``ref``, the video ``rows`` and the oracle's tile blocks per head."""

    def __init__(self, inputs, tile=None):
        q, k, v, layout = inputs[:4]
        self.probs = dense_probs(q, k, 1.0 / math.sqrt(q.shape[-1]))
        self.v64 = v[0].double()
        self.ref = self.probs @ self.v64
        self.rows = layout.video_positions()
        tiles = tile_blocks(layout, tile)
        self.tile_heads = [(tiles[0], tiles[1], tiles[0], tiles[1])] * q.shape[1]

    def oracle(self, densities, blocks_per_head=None):
        return oracle_error(self.probs, self.v64, self.ref, self.rows, blocks_per_head or self.tile_heads,
                            densities)


def evaluate(inputs, reference, name, options, threshold, backend="torch", state=None):
    """One call of method ``name`` at ``threshold`` (every call sparse) on ``inputs``: the row of
    the module docstring (density, kept, predicted, error, oracle, ratio, oracle_own), without
    timings."""
    q, k, v, layout = inputs[:4]
    heads = q.shape[1]
    opts = {"dense_steps": 0, "dense_layers": 0, **options, THRESHOLD[name]: threshold}
    with torch.no_grad():
        out, info = fastdit.attention(q, k, v, name, layout=layout, backend=backend,
                                      state={} if state is None else state, return_info="mass", **opts)
    plan = info["plan"]
    head_density = info["head_density"]
    row = {"name": name, "threshold": threshold, "estimator": build_method(name, options).config.estimator,
           "density": info["density"], "head_density": head_density,
           "kept": sum(info["kept_mass"]) / heads, "head_kept": info["kept_mass"],
           "predicted": float(plan.info["predicted_mass"].double().mean()),
           "head_predicted": plan.info["predicted_mass"].double().mean(0).tolist(),
           "error": video_error(out[0].double(), reference.ref, reference.rows)}
    row["oracle"], row["oracle_density"] = reference.oracle(head_density)
    row["ratio"] = row["error"] / max(row["oracle"], 1e-12)
    if hasattr(plan, "q_blocks"):
        row["oracle_own"], _ = reference.oracle(head_density, [own_blocks(plan, h) for h in range(heads)])
    return row


def run_benchmark(args):
    device = common.pick_device("cpu", args.threads)
    specs = parse_methods(args.methods)
    thresholds = [float(t) for t in split_top_level(args.thresholds)]
    timed_threshold = min(thresholds, key=lambda t: abs(t - 0.9))
    grid = (args.frames, args.height, args.width)
    meta = {**common.machine(device), "grid": grid, "heads": args.heads, "head_dim": args.head_dim,
            "text": args.text, "runs": args.runs, "warmup": args.warmup, "thresholds": thresholds,
            "seed": args.seed, "load_average": os.getloadavg()}
    results = {"meta": meta, "rows": [], "oracle_curve": [], "claims": []}
    for label, name, options in specs:
        if name not in THRESHOLD:
            raise SystemExit(f"--methods: {name!r} does not select by a mass threshold; use one of "
                             f"{sorted(THRESHOLD)}")
    for kind in split_top_level(args.kinds):
        if kind not in KINDS:
            raise SystemExit(f"--kinds: unknown head kind {kind!r}; kinds: {', '.join(KINDS)}")
        inputs = structured_qkv(grid, heads=args.heads, head_dim=args.head_dim, kinds=(kind,) * args.heads,
                                text_len=args.text, seed=args.seed)
        q, k, v = inputs[:3]
        reference = Reference(inputs)
        with torch.no_grad():
            dense_ms = common.time_fn(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
                                      args.runs, args.warmup, False)
        for density in [float(d) for d in split_top_level(args.oracle_densities)]:
            error, real = reference.oracle([density] * args.heads)
            results["oracle_curve"].append({"kind": kind, "density": real, "error": error})
        for label, name, options in specs:
            state = {}  # svg2: later thresholds warm-start from the clustering before, as a pipeline's steps do
            for threshold in thresholds:
                row = {"kind": kind, "method": label,
                       **evaluate(inputs, reference, name, options, threshold, args.backend, state),
                       "dense_ms": dense_ms}
                if args.time and threshold == timed_threshold:  # the cost barely depends on the threshold
                    opts = {"dense_steps": 0, "dense_layers": 0, **options, THRESHOLD[name]: threshold}
                    with torch.no_grad():
                        row.update(selection_ms(name, opts, inputs, args))
                    row["select_over_dense"] = row["select_ms"] / dense_ms
                results["rows"].append(row)
                print(format_row(row), flush=True)
    results["claims"] = claims(results["rows"], specs)
    if args.reuse:  # selection cost with and without reuse across steps (eval/bench/selection/reuse.py)
        from fastdit.eval.bench.selection.reuse import reuse_rows

        results["reuse"] = reuse_rows(args, specs, split_top_level(args.kinds), THRESHOLD, timed_threshold)
    return results


def claims(rows, specs):
    """Issue 23's checks for the entries with the method's default estimator (see the docstring)."""
    out = []
    for row in rows:
        if row["threshold"] not in CLAIM_THRESHOLDS:
            continue
        if row["estimator"] != build_method(row["name"], {}).config.estimator:
            continue
        out.append({"kind": row["kind"], "method": row["method"], **check(row)})
    return out


def check(row):
    """Issue 23's two claims on one row: ``kept >= threshold - 0.05`` (``mass_claim``) and ``error
    <= 2 * oracle``, or ``<= oracle + 0.01`` where ``oracle < 0.005`` (``error_claim``), the oracle
    from ``claim_oracle``; ``error_claim_best``: the same against the lower of the tile oracle
    (where it fits the density) and the method's own-block oracle (the strictest reading)."""
    def within(oracle):
        limit = oracle + SMALL_SLACK if oracle < SMALL_ORACLE else ERROR_FACTOR * oracle
        return "holds" if row["error"] <= limit else "fails"

    oracle = claim_oracle(row)
    best = min(oracle, row.get("oracle_own", oracle))
    return {"threshold": row["threshold"], "kept": row["kept"], "density": row["density"], "error": row["error"],
            "oracle": oracle, "oracle_best": best,
            "mass_claim": "holds" if row["kept"] >= row["threshold"] - MASS_SLACK else "fails",
            "error_claim": within(oracle), "error_claim_best": within(best)}


def claim_oracle(row):
    """The oracle a claim compares with: the tile oracle, unless it could not get down to the
    method's density (one key block per 128-token query block is its floor) and the method has
    its own blocks: then the oracle in the method's own blocks (svg2's clusters)."""
    if "oracle_own" in row and row["oracle_density"] > 1.1 * row["density"] + 0.002:
        return row["oracle_own"]
    return row["oracle"]


def format_row(row):
    own = f" own {row['oracle_own']:.4f}" if "oracle_own" in row else ""
    score = f", score {row['score_ms']:.1f} ms" if "score_ms" in row else ""
    timing = (f"  select {row['select_ms']:.1f} ms ({row['select_over_dense']:.3f} of dense{score})"
              if "select_ms" in row else "")
    return (f"{row['kind']:9s} {row['method']:26s} {row['threshold']:5.3f}  density {row['density']:.3f}  "
            f"kept {row['kept']:.3f}  pred {row['predicted']:.3f}  error {row['error']:.4f}  oracle "
            f"{row['oracle']:.4f}{own}  ratio {row['ratio']:5.2f}{timing}")


def plot(results, path):
    """Error vs density per kind: every entry's sweep and the oracle's curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r["kind"] for r in results["rows"]))
    cols = min(3, len(kinds))
    fig, axes = plt.subplots(-(-len(kinds) // cols), cols, figsize=(4.2 * cols, 3.4 * -(-len(kinds) // cols)),
                             squeeze=False)
    for ax, kind in zip(axes.flat, kinds):
        curve = sorted((p["density"], p["error"]) for p in results["oracle_curve"] if p["kind"] == kind)
        if curve:
            ax.plot(*zip(*curve), "k--", label="oracle (best tile mask)")
        for method in dict.fromkeys(r["method"] for r in results["rows"]):
            points = sorted((r["density"], r["error"]) for r in results["rows"]
                            if r["kind"] == kind and r["method"] == method)
            line, = ax.plot(*zip(*points), "o-", label=method, markersize=3)
            own = sorted((r["density"], r["oracle_own"]) for r in results["rows"]
                         if r["kind"] == kind and r["method"] == method and "oracle_own" in r)
            if own:
                ax.plot(*zip(*own), "x:", color=line.get_color(), label=f"oracle in {method}'s own blocks")
        ax.set_title(kind)
        ax.set_xlabel("density")
        ax.set_ylabel("rel. L2 error")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(kinds):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m fastdit.eval.bench.selection", description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated name or name:option=value:...")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"head kinds, of {','.join(KINDS)}")
    parser.add_argument("--thresholds", default="0.8,0.9,0.95,0.98", help="cdf / top_p values of the sweep")
    parser.add_argument("--oracle-densities", default="0.02,0.05,0.1,0.2,0.3,0.5,0.7,0.9")
    parser.add_argument("--frames", type=int, default=4)
    parser.add_argument("--height", type=int, default=32)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--text", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="torch", choices=("auto", "triton", "torch"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-time", dest="time", action="store_false", help="do not time the selection")
    parser.add_argument("--json", default=None, help="write the results here (and the plot beside, .png)")
    parser.add_argument("--reuse", default="", help="reuse_threshold values: also time the selection over "
                        "--reuse-steps drifting steps with reuse off and at each (eval/bench/selection/reuse.py)")
    parser.add_argument("--reuse-steps", type=int, default=8)
    parser.add_argument("--reuse-max-steps", type=int, default=4)
    parser.add_argument("--drift", type=float, default=0.02, help="input change per step, relative to its scale")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    results = run_benchmark(args)
    for claim in results["claims"]:
        print(f"claim {claim['kind']:9s} {claim['method']:10s} {claim['threshold']}: kept {claim['kept']:.3f} "
              f"({claim['mass_claim']}), density {claim['density']:.3f}, error {claim['error']:.4f} vs oracle "
              f"{claim['oracle']:.4f} ({claim['error_claim']}; against the best of tile and own blocks "
              f"{claim['oracle_best']:.4f}: {claim['error_claim_best']})")
    if args.json:
        dump_json(args.json, results)
        png = os.path.splitext(args.json)[0] + ".png"
        try:
            plot(results, png)
            print(f"wrote {args.json} and {png}")
        except ImportError:
            print(f"wrote {args.json} (no matplotlib: no plot)")
    return results

