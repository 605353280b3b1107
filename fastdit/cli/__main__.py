"""``python -m fastdit.cli`` (and ``torchrun ... -m fastdit.cli compare ... --cp N``): the ``fastdit`` command."""
import sys

from fastdit.cli.command import main

if __name__ == "__main__":
    sys.exit(main())
