"""How far the lossy codecs (``Config.codec``) move gradients: per op of PyTorch's op_db, on a
few stress inputs, and on small randomly initialised HF models and the built-in mini GPT.

Three parts, each comparing input / parameter gradients computed plainly (the reference) with
the same computation under ``Offloader(tier="keep", codec=...)``:

* **op corpus**: every OpInfo of ``op_db`` with autograd and float32 backward on CPU, its first
  ``--max-samples`` float32 samples; the vector-Jacobian product with a fixed random cotangent
  per output (as tests/_support/corpus.py does). Two modes per lossy codec, both with
  ``codec_min_bytes=1`` so that the corpus's small tensors qualify: *default* (``codec_ops``
  empty: the allow list of offloadd/codec/allowlist.py, what users get) and *forced* (``codec_ops`` =
  every torch function the op's forward calls at the outermost level, normally just the op
  itself: every floating saved tensor with an argument's shape is coded).
* **probes**: a few allowed ops on inputs chosen to be hard for per-group ranges (a large common
  offset, one outlier channel, peaky softmax), default allow list, default ``codec_min_bytes``.
* **models**: one training step's parameter gradients of GPT-2, BERT, ViT (transformers, small
  configs, random weights, no downloads) and offloadd's mini GPT, all dropout probabilities 0
  (training mode, so the comparison is deterministic: dropout masks would differ otherwise),
  default allow list and ``codec_min_bytes``.

Errors are relative: ``rel_l2 = ||g_codec - g|| / ||g||`` and ``max_rel = max|g_codec - g| /
max|g|`` over all gradients of a case concatenated (elements where the reference is not finite
left out; a new NaN or infinity makes both infinite). Writes ``<name>.md`` and ``<name>.json``.
Run from the repository root:

    python -m scripts.codec_error --out docs/benchmarks
    python -m scripts.codec_error --quick --out /tmp/codec --codecs none,int8
    python -m scripts.codec_error --from-json docs/benchmarks/NAME.json --notes notes.md
        # render the markdown again, the notes becoming its Conclusions (kept in the JSON)
"""
