"""``python -m fastdit.app``: the same as ``fastdit app``."""
from .launch import main

main()
