"""The Gradio demo (``demo/app.py``): Fast-dLLM and BlockBatch side by side on one prompt.

A package only so that ``import demo.app`` works from the repository root (tests, notebooks);
the Space itself runs ``app.py`` as a script.
"""
