"""``python -m fastdit.kernels.offline``: see the package docstring."""
import sys

from fastdit.kernels.offline import main

sys.exit(main())
