"""The eval run (``fastdit eval``, ``python -m fastdit.eval``), in its phases:

    run.py         ``run_eval``: the whole run
    config.py      what defines a run (``EvalConfig``), ``EvalError``, the results' schema
    settings.py    settings (method + options), samples and their fingerprints
    prompts.py     prompt files (and the shipped ones in ``prompts/``)
    processes.py   one process or several (``accelerate launch``)
    generation.py  phase 1: generate and store samples
    scoring.py     phase 2: per-sample metric values, cached
    aggregate.py   phase 3: results from the stored records
    report.py      results.json, results.md and plots
    storage.py     the files under the output folder
"""
