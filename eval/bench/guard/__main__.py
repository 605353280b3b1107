"""``python -m fastdit.eval.bench.guard``."""
from . import main

raise SystemExit(main())
