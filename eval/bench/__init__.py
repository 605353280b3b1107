"""Benchmarks: scripts that print tables and write JSON (see BENCHMARKS.md), one entry point each:

    python -m fastdit.eval.bench.attention      dense SDPA vs the block-sparse kernel (--path kernel|patched|methods)
    python -m fastdit.eval.bench.methods        every method on structured video-like inputs, per head kind
    python -m fastdit.eval.bench.transformer    one transformer forward, dense vs methods, eager and compiled
    python -m fastdit.eval.bench.varlen         variable-size blocks vs fixed-size blocks at equal density
    python -m fastdit.eval.bench.calibration    a calibrated plan against every single global setting
    python -m fastdit.eval.bench.radial_report  radial attention's densities and mask picture
    python -m fastdit.eval.bench.equal_density  every method at one density on tiny-shapes, training-free and trained

Their parts: ``attention_kernel``, ``attention_check`` and ``attention_patched`` (the attention benchmark's
paths), ``methods_claims``, ``transformer_models`` and ``transformer_run``; ``common`` (timing, memory, the
machine, the report) and ``structured`` (video-like q, k, v with known structure, also used by tests).
"""
