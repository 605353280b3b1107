"""Calibration: search per-layer method settings on a few prompts and write them as a plan file.

    search.py      ``fastdit.calibrate``: the search itself (``fastdit calibrate`` on the command line)
    candidates.py  the settings a method offers the search (a registry: add a method's candidates here)
    plan_file.py   plan files: writing, reading, checking them against a model (``fastdit.patch(..., plan=)``)
"""
