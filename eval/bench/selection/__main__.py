"""``python -m fastdit.eval.bench.selection``: see the package docstring."""
from fastdit.eval.bench.selection import main

main()
