"""The ``fastdit`` command line, one module per subcommand:

    command.py    the parser, ``main`` and the small listings (``fastdit methods``, ``fastdit support``)
    compare.py    ``fastdit compare``
    eval.py       ``fastdit eval`` (also ``python -m fastdit.eval``)
    calibrate.py  ``fastdit calibrate``
    common.py     what the subcommands share: argument types, generation arguments, error handling

(``fastdit app``'s arguments live with the app, ``fastdit.app.launch``.)
"""
from fastdit.cli.command import main

__all__ = ["main"]
