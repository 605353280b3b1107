"""``python -m fastdit.eval`` / ``accelerate launch -m fastdit.eval``: the ``fastdit eval`` run.

Under ``accelerate launch`` (or ``torchrun``) each process generates and scores its share of the
samples (accelerate's ``split_between_processes``, per setting), writes them under ``--out``
(a folder all processes share), waits for the others, and the main process writes
``results.json``, ``results.md`` and the plots; results.json does not depend on the number of
processes apart from its timing fields. On a CPU-only machine launch with
``accelerate launch --multi_gpu --num_processes N -m fastdit.eval ...`` (accelerate's ``--cpu``
alone starts a single process unless MPI is set up); the processes then use gloo.
"""
import sys

from fastdit.cli.eval import main

if __name__ == "__main__":
    sys.exit(main())
