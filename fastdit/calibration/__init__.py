"""Calibration: search per-layer method settings on a few prompts and write them as a calibration file.

    search.py      ``fastdit.calibrate``: the search itself (``fastdit calibrate`` on the command line)
    candidates.py  the settings a method offers the search (a registry: add a method's candidates here)
    calibration_file.py  calibration files: writing, reading, checking them against a model
                   (``fastdit.patch(..., calibration=)``; ``plan_file`` and ``plan=``: the earlier names)
"""
