"""The lab: experiments and benchmark scripts beside the package (scripts/README.md lists every
one, its command, and the rules: they import offloadd, never the reverse). Run from the
repository root: ``python scripts/NAME.py``, or ``python -m scripts.NAME`` for those split into a
package (codec_error, codec_convergence)."""
