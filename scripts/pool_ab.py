"""One ssd run of HF GPT-2 (bench step's steady-offloading point) with the host cache's slack and the
read-back records' home chosen: what Note [one pool] in offloadd/io/pools.py was measured with.

    python scripts/pool_ab.py --slack 0.4 --records cache   # as shipped
    python scripts/pool_ab.py --slack 0.4 --records pool    # read-backs in the read pool

Prints one JSON line: the step times, peak RSS above the model (MiB), and the host cache's
misses and freshly mapped MiB per timed step (blocks unmapped and mapped again: churn). Run the
two alternately, each in its own process, as docs/benchmarks/steady-pool_hf-gpt2_* did.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from offloadd.runtime import host_allocator
from offloadd.runtime.host_allocator import HostCacheCounters
from offloadd.tools.harness import step_trace, train


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slack", type=float, default=host_allocator.SLACK)
    p.add_argument("--records", choices=("cache", "pool"), default="cache")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    ns = p.parse_args()
    if ns.records == "pool":  # the reader asks serves() whether the host cache takes a record
        host_allocator.serves = lambda nbytes: False  # type: ignore[assignment]
    defaults = list(host_allocator.HostCache.install.__defaults__ or ())
    defaults[2] = ns.slack  # install(min_bytes, floor_bytes, slack, huge_pages)
    host_allocator.HostCache.install.__defaults__ = tuple(defaults)
    marks: list[HostCacheCounters] = []
    end = step_trace.StepTrace.end

    def counted_end(self: step_trace.StepTrace, stats: Any) -> dict[str, Any]:
        rec = end(self, stats)
        cache = host_allocator.current()
        if cache is not None:
            marks.append(cache.counters())
        return rec

    step_trace.StepTrace.end = counted_end  # type: ignore[method-assign]
    spec = train.RunSpec(
        strategy="ssd", model="gpt", num_layers=8, d_model=512, num_heads=8, seq_len=512,
        batch_size=4, vocab_size=2000, steps=ns.steps, warmup=ns.warmup,
    )  # fmt: skip
    out = train.run(spec)
    w = out["warmup_steps"]
    timed = len(marks) - w
    first, last = marks[w - 1], marks[-1]
    print(
        json.dumps(
            {
                "slack": ns.slack,
                "records": ns.records,
                "step": out["step_time_s"],
                "steps": out["step_times_s"],
                "rss_mib": out["peak_rss_above_base"] / 2**20,
                "misses_per_step": (last.misses - first.misses) / timed,
                "mapped_mib_per_step": (last.mapped_bytes - first.mapped_bytes) / timed / 2**20,
                "unpack_s": out["trace_median"].get("unpack_s"),
                "pack_s": out["trace_median"].get("pack_s"),
            }
        )
    )


if __name__ == "__main__":
    main()
