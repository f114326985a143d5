"""``python -m scripts.codec_convergence``: the runs, in turn, within ``--max-minutes``, and the
outputs written (see the package's docstring)."""

from __future__ import annotations

import datetime
import sys
import time

import torch

from . import training
from .options import codec_provenance, parse_args
from .report import plot, verdict, write_csv, write_markdown
from .training import Run, batch_starts, load_corpus, reference_grad, train

# -- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.provenance = codec_provenance()
    training.SEED0 = args.seed  # the seed of the codec runs, for their labels
    if args.threads:
        torch.set_num_threads(args.threads)
    started = datetime.datetime.now(datetime.UTC)
    t_all = time.perf_counter()
    corpus = load_corpus()
    print(
        f"corpus: {len(corpus.train):,} training bytes, {len(corpus.held_out):,} held out; "
        f"model {args.layers}x{args.d_model}, seq {args.seq}, batch {args.batch}, "
        f"{args.steps} steps; codecs {', '.join(args.codecs)}; tier {args.tier}; "
        f"{torch.get_num_threads()} threads",
        flush=True,
    )
    n = len(corpus.train)
    starts = batch_starts(n, args.seq, args.batch, args.steps, args.seed)
    ref = reference_grad(args, corpus, starts)
    runs: list[Run] = []
    plan = (
        [(c, args.seed, "") for c in args.codecs]
        + [("none", args.seed, f"perturb{k}") for k in range(1, args.perturb_runs + 1)]
        + [("none", args.seed, f"noise{k}") for k in range(1, args.noise_runs + 1)]
        + [("none", s, "") for s in args.extra_seeds]
    )
    skipped: list[str] = []
    for codec, seed, control in plan:
        elapsed = time.perf_counter() - t_all
        if (seed != args.seed or control) and args.max_minutes and runs:
            per_run = max(r.wall_s for r in runs)
            if elapsed + per_run > 60 * args.max_minutes:
                label = Run(codec, seed, control).label
                skipped.append(label)
                print(f"skipping {label}: {elapsed:.0f} s + {per_run:.0f} s per run")
                continue
        s = starts if seed == args.seed else batch_starts(n, args.seq, args.batch, args.steps, seed)
        run = train(args, corpus, codec, seed, s, ref if seed == args.seed else None, control)
        runs.append(run)
        base = runs[0]
        print(
            f"{run.label}: final {run.final(args.window):.4f} "
            f"(x{run.final(args.window) / base.final(args.window):.4f} of none), "
            f"held-out {run.held_out:.4f}, grad error {run.grad_rel_err:.2e} "
            f"(end {run.grad_rel_err_end:.2e}), "
            f"{run.wall_s:.0f} s",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / args.name
    write_csv(stem.with_suffix(".csv"), runs)
    plot(stem.with_suffix(".png"), runs, args)
    total = time.perf_counter() - t_all
    write_markdown(stem.with_suffix(".md"), runs, corpus, args, argv, started, total, skipped)
    print(f"wrote {stem}.md, .csv, .png ({total:.0f} s)")
    base = runs[0]
    failed = [
        r.codec
        for r in runs
        if r.main and verdict(r.codec, r.final(args.window) / base.final(args.window)) == "FAIL"
    ]
    if failed:
        print(f"outside the target: {', '.join(failed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
