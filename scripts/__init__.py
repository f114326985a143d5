"""Experiments and benchmark scripts, run from the repository root: ``python scripts/NAME.py``, or
``python -m scripts.NAME`` for those split into a package (codec_error, codec_convergence)."""
