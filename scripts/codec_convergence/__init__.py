"""Convergence of a small GPT trained with each lossy activation codec, against exact (none).

The built-in GPT (offloadd.tools.models.gpt) is trained byte-level (vocabulary 256) on a real
English corpus available offline: the Python reference documentation shipped with the standard
library (``pydoc_data.topics``), topics in sorted order, the first 90 % of the bytes for training
and the last 10 % held out. Every run starts from the same initial weights and sees the same
batches in the same order; only the codec of the :class:`~offloadd.Offloader` around forward
differs (``none``: the same Offloader, activations saved exactly). Written to ``--out``:

* ``NAME.csv``: the training loss of every run, one row per step;
* ``NAME.png``: loss curves (raw faint, smoothed solid) and the smoothed gap to none in percent;
* ``NAME.md``: command, machine, per codec the final loss (mean of the last 50 steps), its ratio
  to none's, the held-out loss, the target (1 % int8 and fp8, 3 % int4, int2 reported only),
  pass or fail, the bytes saved for backward per step, step time, and the spread of none itself
  in control runs (``--perturb-runs``: initial weights perturbed by a relative 1e-6;
  ``--noise-runs``: unbiased noise of 1 % added to every gradient, larger than an 8-bit codec's
  error; ``--extra-seeds``: other weights and batch order), which says whether a gap is signal;
  and each codec's gradient error at the first step and on its final weights.

Run from the repository root:

    python -m scripts.codec_convergence --quick --out /tmp/cc          # smoke run, ~1 minute
    python -m scripts.codec_convergence --out docs/benchmarks           # the full run
"""
