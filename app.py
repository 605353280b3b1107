"""Hugging Face Spaces entry point: the fastdit Gradio app (the code lives in fastdit/app/).

The repository's ``kernels/`` folder is installed as ``fastdit.kernels``. Run as ``python app.py``,
this folder is on ``sys.path``, so ``kernels/`` would also be importable as a top-level ``kernels``
package, where transformers looks for Hugging Face's ``kernels`` library: it would import fastdit's
kernels a second time, from a worker thread, and register fastdit's custom attention ops again,
which breaks them. fastdit is imported as installed instead.
"""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

from fastdit.app import main  # noqa: E402

if __name__ == "__main__":
    main()
