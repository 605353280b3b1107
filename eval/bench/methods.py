"""Benchmark: every attention method on structured video-like inputs, per head kind.

Run ``python -m fastdit.eval.bench.methods --methods sta,sparge,svg`` (options below). Inputs come
from ``fastdit.eval.bench.structured`` (see its docstring: heads whose attention is spatially local,
temporal, global or semantic, by construction; ``--kinds`` picks them, default
spatial,temporal,global; ``--objects`` sets the semantic heads' object count), one input set per
head kind with every head of that kind,
the same for every method. Methods run at ``dense_steps=0, dense_layers=0`` (every call sparse)
through the method protocol, exactly as ``fastdit.attention`` runs them.

Method list: comma-separated ``name`` or ``name:option=value:option=value`` (values as the CLI's
``--set`` reads them, e.g. ``sparge:topk=0.2``, ``sta:tile=(4,4,8)``). ``--corrections
pooled,cached`` adds, for every block-sparse method, one variant per correction. When ``sta`` runs
(its first entry, at any options), ``sparge`` and ``svg`` also run at sta's density of each kind
(``sparge`` with ``topk``, ``svg`` with ``density``, labelled ``@sta``). Every ``svg2`` entry (an
operating point) gets ``sta``, ``svg`` and ``sparge`` companions fitted to its measured density
on each kind by ``match_companion`` (plan densities computed before the run: sparge's ``topk``
rescaled, svg's ``block_size`` lowered from its configured one to 64, 32, 16 until one block row
is small enough, sta's odd window in tiles), labelled ``@svg2`` for the first entry and
``@<entry>`` for later ones; a fit outside the tolerance is printed "not reachable". ``--match``
adds options to all same-density runs, e.g. ``--match x:tile=(2,4,4)`` (each run takes the ones
its method has), so the claims below compare like with like.

svg2 operating points used for issue 17 (BENCHMARKS.md): the defaults (100 / 500 clusters,
``top_p = 0.9``), ``svg2:q_clusters=400:k_clusters=1000:top_p=0.999`` (the paper's HunyuanVideo
cluster counts; ``top_p`` raised until the density of spatial and temporal heads is ~0.02-0.06 at
12x16x24) and ``svg2:q_clusters=400:k_clusters=1000:min_kc_ratio=0.1`` (its scripts' floor).

Default size: Wan2.1 480p x 81 frames (21x30x52 = 32760 video tokens), 2 heads, D=64, where the
5% prediction-cost claim applies (a GPU run). On a CPU pass a smaller grid, e.g. ``--frames 12
--height 16 --width 24 --methods sta:tile=(2,4,4),sparge,svg --match x:tile=(2,4,4)``.
Unknown methods are reported and skipped.

Columns, per method and head kind (one call over all heads of that kind):
  * ``density``: query-key score computations performed / dense attention's (``info["density"]``
    of ``fastdit.attention``; padding slots excluded, text included);
  * ``rel_l2``: ``||out - dense|| / ||dense||`` over the video query rows, dense being float32
    SDPA on the same inputs; ``kept``: the true softmax mass the call kept (block-sparse methods:
    ``fastdit.functional.kept_mass`` of the call's log-sum-exp, mean over heads and query rows);
  * ``select_ms``: ``method.select(ctx, q, k)`` alone (block-sparse methods; the prediction of
    dynamic ones, a cache lookup for static ones); ``attention_ms``: ``run_plan`` on that plan
    (block-sparse methods), or a dense SDPA of the shape the method really attended
    (``ctx.info["attention_shape"]``, token methods); ``total_ms``: the whole call;
    ``outside_ms`` = total - attention (selection, gathers, pooling, caches, corrections);
    ``saved_ms`` = dense SDPA - attention (the attention time the method saves);
  * ``peak_mb``: peak memory of one untimed call above what was allocated before it (CUDA only);
  * ``select/dense``: the selection time over dense SDPA's (sparge's prediction cost claim:
    at most 5% at N >= 32k on the GPU);
  * svg2 only (methods with ``cluster`` / ``plan_from_clusters``): ``cluster_ms`` (k-means of a
    warm-started call: ``kmeans_iters`` iterations from the stored centroids), ``cluster_cold_ms``
    (a cold start: ``init_iters`` iterations, as the first sparse call of a layer and branch),
    ``score_ms`` (centroid scores, top-p selection and the plan), and their ratios to dense SDPA
    ``cluster_over_dense`` (warm clustering + scoring; svg2's claim: under 10% at N >= 32k on the
    CPU) and ``cold_over_dense``. ``select_ms`` is then a warm call's whole selection.

Timings: ``--warmup`` untimed calls, then the median of ``--runs`` timed ones; CUDA events with
synchronisation around every call on the GPU, ``perf_counter`` on the CPU. ``correction=cached``
variants first run one refresh call (step 0) on inputs perturbed by 10% toward another draw of
the generator (consecutive denoising steps are close, not equal), then are measured at step 1.

Claims printed at the end (each "holds" / "fails" / "not run"): on temporal heads sparge@sta and
svg@sta have lower error than sta at no more than sta's density (+0.02); per svg2 entry and
kind (spatial, temporal: issue 17; semantic as an extra line), svg2 has lower error than its
svg and sparge companions at the same density ("holds" / "fails" / "undecided" by the same-budget
rule of ``bench_methods_claims``: within 25% of svg2's kept (above 0.5: dropped) fraction, or a companion worse on more
budget / better on less; sta@svg2 is printed alongside), and issue 17's verdict over spatial and
temporal heads; every correction lowers its method's error (all kinds, same plan density).
"""
from __future__ import annotations

import argparse
import inspect
import sys

import torch

from fastdit.context import new_context
from fastdit.cpu_load import LoadWatch
from fastdit.eval.bench import common
from fastdit.eval.bench import methods_claims as claims_module
from fastdit.eval.bench.methods_claims import claims, print_table
from fastdit.eval.bench.structured import DEFAULT_KINDS, DEFAULT_OBJECTS, KINDS, structured_qkv
from fastdit.functional import call_info, dense_lse, kept_mass
from fastdit.intercept import plain_sdpa
from fastdit.jsonutil import dump_json
from fastdit.methods import get_method, method_names
from fastdit.methods.block_sparse import BlockSparseMethod
from fastdit.options import parse_value
from fastdit.plan import run_plan



def split_top_level(text, sep=","):
    """Split on ``sep`` outside parentheses and brackets (option values may hold tuples)."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char in "([" and 1 or char in ")]" and -1 or 0
        if char == sep and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def parse_methods(text):
    """``[(label, name, options)]`` from ``name`` / ``name:opt=value:...`` items."""
    specs = []
    for item in split_top_level(text):
        name, *pairs = split_top_level(item, ":")
        options = {}
        for pair in pairs:
            if "=" not in pair:
                raise ValueError(f"method option {pair!r} of {item!r} must be option=value")
            key, value = pair.split("=", 1)
            options[key.strip()] = parse_value(value)
        specs.append((item, name.strip(), options))
    return specs


def make_call(method, layout, q, k, v, state=None, step=0, num_steps=8, backend="auto"):
    """``(ctx, run)``: an ``AttentionContext`` as ``fastdit.attention`` builds it, and a function
    running the method on it (a fresh ``ctx.info`` each call)."""
    ctx = new_context(layout=layout, num_heads=q.shape[1], step=step, num_steps=num_steps,
                      state={} if state is None else state, backend=backend, dense_fn=lambda: plain_sdpa(q, k, v))

    def run():
        ctx.info = {}
        return method(ctx, q, k, v)

    return ctx, run


def video_error(out, ref, layout):
    rows = layout.video_positions(out.device)
    return common.rel_error(out[:, :, rows], ref[:, :, rows])


def measure(name, options, inputs, refresh_inputs, ref, dense_ms, args, cuda):
    """One method variant on one kind's inputs: a dict of the columns (see the module docstring)."""
    method = build_method(name, options)
    config = method.config
    q, k, v, layout = inputs.q, inputs.k, inputs.v, inputs.layout
    method.check_heads(q.shape[1])
    state, step = {}, 0
    if getattr(config, "correction", None) == "cached":  # a refresh step first, on nearby inputs
        _, refresh = make_call(method, layout, *refresh_inputs, state=state, step=0, backend=args.backend)
        refresh()
        step = 1
    ctx, run = make_call(method, layout, q, k, v, state=state, step=step, backend=args.backend)
    with torch.no_grad():
        out = run()
        info = call_info(ctx, q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        row = {"density": info["density"], "rel_l2": video_error(out, ref, layout),
               "finite": bool(torch.isfinite(out).all())}
        if "lse" in ctx.info:  # the true softmax mass the call kept, mean over heads and query rows
            masses = kept_mass(ctx.info["lse"], dense_lse(q, k))
            row["kept_mass"] = sum(masses) / len(masses)
        row["total_ms"] = common.time_fn(run, args.runs, args.warmup, cuda)
        row["select_ms"] = row["attention_ms"] = None
        if hasattr(method, "plan_from_clusters") and "plan" in ctx.info:
            row.update(cluster_split(method, ctx, q, k, dense_ms, args, cuda))
        if isinstance(method, BlockSparseMethod) and "plan" in ctx.info:
            # svg's select also takes v (it scores patterns by sampled outputs)
            takes_v = "v" in inspect.signature(method.select).parameters
            select = (lambda: method.select(ctx, q, k, v)) if takes_v else (lambda: method.select(ctx, q, k))
            row["select_ms"] = common.time_fn(select, args.runs, args.warmup, cuda)
            plan = select()
            try:
                row["attention_ms"] = common.time_fn(lambda: run_plan(q, k, v, plan, backend=args.backend),
                                                     args.runs, args.warmup, cuda)
            except Exception as error:  # a plan run_plan cannot take alone: report the derived value
                row["attention_note"] = common.first_line(error)
                row["attention_ms"] = row["total_ms"] - row["select_ms"]
        elif "attention_shape" in ctx.info:
            queries, keys = ctx.info["attention_shape"]
            shaped = [torch.randn(q.shape[0], q.shape[1], n, q.shape[3], device=q.device, dtype=q.dtype)
                      for n in (queries, keys, keys)]
            row["attention_shape"] = (queries, keys)
            row["attention_ms"] = common.time_fn(lambda: plain_sdpa(*shaped), args.runs, args.warmup, cuda)
        elif ctx.info.get("dense") or name == "dense":
            row["attention_ms"] = row["total_ms"]
        if row["attention_ms"] is not None:
            row["outside_ms"] = row["total_ms"] - row["attention_ms"]
            row["saved_ms"] = dense_ms - row["attention_ms"]
        if row["select_ms"] is not None:
            row["select_over_dense"] = row["select_ms"] / dense_ms
        row["peak_mb"] = common.peak_memory_mb(run, cuda) if cuda else None
    return row


def cluster_split(method, ctx, q, k, dense_ms, args, cuda):
    """svg2's selection in parts: warm and cold clustering, then scoring and selection (ms)."""
    key = method.state_key  # where the warm-start centroids live in ctx.state
    stored = ctx.state.get(key)

    def cold():
        ctx.state.pop(key, None)
        return method.cluster(ctx, q, k)

    cold_ms = common.time_fn(cold, args.runs, args.warmup, cuda)
    if stored is not None:
        ctx.state[key] = stored
    warm_ms = common.time_fn(lambda: method.cluster(ctx, q, k), args.runs, args.warmup, cuda)
    clusters = method.cluster(ctx, q, k)
    score_ms = common.time_fn(lambda: method.plan_from_clusters(ctx, clusters, q, k), args.runs, args.warmup, cuda)
    return {"cluster_ms": warm_ms, "cluster_cold_ms": cold_ms, "score_ms": score_ms,
            "cluster_over_dense": (warm_ms + score_ms) / dense_ms, "cold_over_dense": (cold_ms + score_ms) / dense_ms}


def kind_inputs(kind, args, device, dtype, seed=0):
    return structured_qkv((args.frames, args.height, args.width), heads=args.heads, head_dim=args.head_dim,
                          kinds=(kind,) * args.heads, text_len=args.text, text_position="suffix",
                          seed=seed, objects=args.objects, device=device, dtype=dtype)


def nearby(a, b, amount=0.1):
    """``a`` moved ``amount`` of the way toward ``b`` (a neighbouring denoising step's inputs)."""
    return [x + amount * (y - x) for x, y in zip(a, b)]


#: Same-density companions: reference method -> [(method, option matched to the reference's
#: density, whether the method must be in --methods too)]. sta's companions follow its first
#: entry; svg2's follow every svg2 entry (each operating point gets its own).
COMPANIONS = {"sta": [("sparge", "topk", True), ("svg", "density", True)],
              "svg2": [("sta", "window", False), ("svg", "density", False), ("sparge", "topk", False)]}
#: Block sizes svg tries, from its configured one down, to reach a low density.
SVG_BLOCK_SIZES = (128, 64, 32, 16)


def variants(specs, corrections, registered):
    """The runs: each spec, same-density companions of sta and svg2, and correction variants.
    A companion's last item is ``(reference label, option, fitted)``; other runs have None there.
    ``fitted``: svg2's companions are fitted to its density by ``match_companion``; sta's keep
    the plain rule (``option = sta's density``) of the published tables."""
    runs, skipped = [], []
    for label, name, options in specs:
        if name not in registered:
            skipped.append((label, f"unknown method {name!r}; registered: {', '.join(registered)}"))
            continue
        runs.append((label, name, options, None))
    present = {n for _, n, _, _ in runs}
    references = []  # (label, method, tag of the companions' labels)
    for label, name, _, _ in list(runs):
        if name == "sta" and not any(r[1] == "sta" for r in references):
            references.append((label, name, "sta"))
        elif name == "svg2":  # the first svg2 entry's companions are "x@svg2", later ones "x@<label>"
            references.append((label, name, label if any(r[1] == "svg2" for r in references) else "svg2"))
    for reference, method, tag in references:
        for name, option, needs_run in COMPANIONS[method]:
            if name in registered and (name in present or not needs_run):
                runs.append((f"{name}@{tag}", name, {}, (reference, option, method == "svg2")))
    extra = []
    for label, name, options, same in runs:
        fields = getattr(get_method(name).config_cls, "__dataclass_fields__", {})
        if "correction" in fields and "correction" not in options:
            for correction in corrections:
                extra.append((f"{label}:correction={correction}", name, {**options, "correction": correction}, same))
    return runs + extra, skipped


def build_method(name, options):
    cls = get_method(name)
    # the method alone (the quality guard is measured by eval.bench.guard): guard off unless asked
    return cls(cls.resolve(cls.make_config(**{"dense_steps": 0, "dense_layers": 0, "guard": False, **options}), None))


def plan_density(name, options, inputs, args):
    """The density (token pairs, as ``info["density"]``) of the plan ``name`` selects on ``inputs``,
    without running the attention (1.0 when the method would run dense)."""
    method = build_method(name, options)
    q, k, v, layout = inputs.q, inputs.k, inputs.v, inputs.layout
    ctx, _ = make_call(method, layout, q, k, v, backend=args.backend)
    ctx.info = {}
    with torch.no_grad():
        takes_v = "v" in inspect.signature(method.select).parameters
        plan = method.select(ctx, q, k, v) if takes_v else method.select(ctx, q, k)
    if plan is None:
        return 1.0
    return float(plan.pair_counts().double().mean()) / float(layout.seq_len) ** 2


def match_companion(name, option, target, options, inputs, args, reference="the reference"):
    """``(options, note)``: ``options`` with ``option`` set so that ``name`` runs at about density
    ``target`` (``reference``'s measured one; tolerance: ``bench_methods_claims.density_tolerance``).
    sparge: ``topk = target``, rescaled by ``target / plan density`` (up to 4 times) while its
    plan (whole key blocks, at least ``min_blocks``) is off. svg: ``density = target`` at the
    largest block size of ``SVG_BLOCK_SIZES`` (from its configured one down) whose plan is within
    the tolerance (one block row of 128 tokens can be far above ``target``). sta: the odd window
    (tiles per axis) whose plan density is closest. The note says what was chosen, and "not
    reachable" when even the best choice is outside the tolerance."""
    options = dict(options)
    tolerance = claims_module.density_tolerance(target)
    if option == "topk":
        choices = [{"topk": min(1.0, target)}]
    elif option == "density":
        options["density"] = min(1.0, target)
        start = build_method(name, options).config.block_size
        choices = [{"block_size": b} for b in (start,) + tuple(b for b in SVG_BLOCK_SIZES if b < start)]
    else:
        method = build_method(name, options)
        n_tiles = [-(-g // t) for g, t in zip(inputs.layout.grid, method.tile_for(inputs.layout))]
        odd = [list(range(1, n + 1 + (n % 2 == 0), 2)) for n in n_tiles]
        choices = [{"window": (a, b, c)} for a in odd[0] for b in odd[1] for c in odd[2]]
    best, rescales = None, 0
    while choices:
        choice = choices.pop(0)
        density = plan_density(name, {**options, **choice}, inputs, args)
        if best is None or abs(density - target) < abs(best[1] - target):
            best = (choice, density)
        if option != "window" and abs(density - target) <= tolerance:
            break
        if option == "topk" and density > 0 and rescales < 4:  # rescale topk toward the target density
            rescales += 1
            choices.append({"topk": min(1.0, choice["topk"] * target / density)})
    options.update(best[0])
    chosen = ", ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                       for key, value in best[0].items())
    return options, (f"{chosen}: plan density {best[1]:.3f} for {reference}'s {target:.3f}"
                     + ("" if abs(best[1] - target) <= tolerance else " (not reachable within the tolerance)"))


def run_benchmark(args):
    device = common.pick_device(args.device, args.threads)
    cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype)
    registered = method_names()
    specs = parse_methods(args.methods)
    runs, skipped = variants(specs, [c for c in split_top_level(args.corrections) if c != "none"], registered)
    references = {same[0] for *_, same in runs if same is not None}
    for label, message in skipped:
        print(f"skipped {label}: {message}", file=sys.stderr)
    results = {"meta": {**common.machine(device), "grid": (args.frames, args.height, args.width),
                        "heads": args.heads, "head_dim": args.head_dim, "text": args.text, "dtype": args.dtype,
                        "runs": args.runs, "warmup": args.warmup, "backend": args.backend, "objects": args.objects},
               "skipped": dict(skipped), "rows": [], "claims": {}}
    results["meta"]["tokens"] = args.frames * args.height * args.width + args.text
    for kind in split_top_level(args.kinds):
        if kind not in KINDS:
            raise SystemExit(f"--kinds: unknown head kind {kind!r}; kinds: {', '.join(KINDS)}")
        if kind == "temporal" and args.frames < 2:
            continue
        inputs = kind_inputs(kind, args, device, dtype)
        other = kind_inputs(kind, args, device, dtype, seed=1)
        refresh_inputs = nearby(inputs[:3], other[:3])
        with torch.no_grad(), LoadWatch() as load:
            ref = plain_sdpa(*(t.float() for t in inputs[:3]))
            dense_ms = common.time_fn(lambda: plain_sdpa(*inputs[:3]), args.runs, args.warmup, cuda)
        results["rows"].append({"method": "dense", "kind": kind, "density": 1.0, "rel_l2": 0.0,
                                "total_ms": dense_ms, "attention_ms": dense_ms, "load": load.record})
        common.warn_if_shared(load.record, f"dense on {kind} heads")
        reference_density = {}  # label of a reference run (sta's first, every svg2) -> its density on this kind
        match = dict(parse_methods(args.match)[0][2]) if args.match else {}
        for label, name, options, same in runs:
            options, note = dict(options), None
            try:
                if same is not None:
                    reference, option, fitted = same
                    if reference not in reference_density:
                        continue
                    fields = get_method(name).config_cls.__dataclass_fields__
                    options.update({key: value for key, value in match.items() if key in fields})
                    if fitted:
                        options, note = match_companion(name, option, reference_density[reference], options,
                                                        inputs, args, reference)
                    else:
                        options[option] = min(1.0, reference_density[reference])
                with LoadWatch() as load:
                    row = measure(name, options, inputs, refresh_inputs, ref, dense_ms, args, cuda)
                row["load"] = load.record
                common.warn_if_shared(load.record, f"{label} on {kind} heads")
            except Exception as error:
                row = {"error": common.first_line(error, 300)}
                print(f"{label} on {kind} heads failed: {row['error']}", file=sys.stderr)
            row.update(method=label, kind=kind, options=options)
            if same is not None:
                row["same_as"] = same[0]
                if note:
                    row["match_note"] = note
            elif label in references and label not in reference_density and "density" in row:
                reference_density[label] = row["density"]
                row["same_density_reference"] = True
            results["rows"].append(row)
    results["claims"] = claims(results["rows"])
    return results


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m fastdit.eval.bench.methods", description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default="sta,sparge,svg", help="comma-separated name or name:option=value:...")
    parser.add_argument("--corrections", default="none", help="extra correction variants: pooled,cached,ear")
    parser.add_argument("--kinds", default=",".join(DEFAULT_KINDS),
                        help=f"head kinds to run, of {','.join(KINDS)} (default: {','.join(DEFAULT_KINDS)})")
    parser.add_argument("--objects", type=int, default=DEFAULT_OBJECTS, help="objects of semantic heads")
    parser.add_argument("--match", default="", help="options for the @sta runs, as x:option=value:...")
    parser.add_argument("--frames", type=int, default=21)
    parser.add_argument("--height", type=int, default=30)
    parser.add_argument("--width", type=int, default=52)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--text", type=int, default=0, help="text tokens after the video")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--backend", default="auto", choices=("auto", "triton", "torch"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", default=None, help="write the results here")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.runs < 1 or args.warmup < 0:
        raise SystemExit("--runs must be >= 1 and --warmup >= 0")
    try:
        parse_methods(args.methods)
    except ValueError as error:
        raise SystemExit(str(error))
    results = run_benchmark(args)
    print_table(results)
    if args.json:
        dump_json(args.json, results)
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
