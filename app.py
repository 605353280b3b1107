"""Hugging Face Spaces entry point: the fastdit Gradio app (the code lives in fastdit/app.py)."""
from fastdit.app import main

if __name__ == "__main__":
    main()
