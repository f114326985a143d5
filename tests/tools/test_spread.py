"""Figures with their spread (tools/harness/spread.py) in rok's, wall's and bench hooks' reports:
a ratio with the range its timed steps allow, marked where that range holds 1.0x."""

from __future__ import annotations

from typing import Any

import pytest

from offloadd.tools.bench.hooks import format_report
from offloadd.tools.harness.spread import UNRESOLVED, fmt_ratio, quotient_range, ratio_range
from offloadd.tools.rok.summary import aggregate, compare, summary_lines
from offloadd.tools.wall.search import Wall
from offloadd.tools.wall.summary import contested, points, summary


def point(strategy: str, batch: int, lo: float, mid: float, hi: float) -> dict[str, Any]:
    return {
        "strategy": strategy,
        "batch_size": batch,
        "round": 1,
        "status": "ok",
        "error": None,
        "activation_peak_bytes": 1000,
        "step_time_s": mid,
        "step_time_min_s": lo,
        "step_time_max_s": hi,
        "samples_per_s": batch / mid,
    }


def test_a_ratio_has_the_range_of_its_steps() -> None:
    fast, slow = point("a", 4, 0.9, 1.0, 1.1), point("b", 4, 1.8, 2.0, 2.2)
    assert ratio_range(fast, slow) == pytest.approx((1.8 / 1.1, 2.2 / 0.9))
    assert ratio_range(point("a", 8, 1.0, 1.0, 1.0), slow) == pytest.approx((3.6, 4.4))
    assert fmt_ratio(2.0, ratio_range(fast, slow)) == "2.00x (1.64-2.44)"
    near = point("c", 4, 0.95, 1.05, 1.3)
    assert fmt_ratio(0.95, ratio_range(near, fast)).endswith("~")  # 0.69-1.16 holds 1.0x
    assert ratio_range({"batch_size": 1, "step_time_min_s": 1.0}, fast) is None  # no spread
    assert fmt_ratio(1.5, None) == "1.50x"
    assert quotient_range((2.0, 4.0), (1.0, 2.0)) == (1.0, 4.0)


def test_rok_marks_what_a_run_does_not_resolve() -> None:
    rows = [point("keep", 2, 1.0, 1.0, 1.02), point("offload-ssd", 2, 1.01, 1.03, 1.4)]
    (c,) = compare(aggregate(rows), "offload-ssd")
    assert c["thr_vs_keep_range"] == pytest.approx((1.0 / 1.4, 1.02 / 1.01))
    lines = summary_lines(aggregate(rows))
    assert "thr 0.97x (0.71-1.01)~" in lines[1] and lines[-1] == UNRESOLVED
    rows[1].update(step_time_min_s=1.1, step_time_s=1.2, step_time_max_s=1.3, samples_per_s=2 / 1.2)
    assert UNRESOLVED not in summary_lines(aggregate(rows))
    del rows[1]["step_time_max_s"]  # a sweep from before the column: the figure alone
    assert "thr 0.83x |" in summary_lines(aggregate(rows))[1]


def test_wall_compares_auto_with_the_fastest_other_where_both_train() -> None:
    rows = [
        point("plain", 2, 1.0, 1.0, 1.0),
        point("recompute", 2, 1.2, 1.3, 1.4),
        point("auto", 2, 0.98, 1.01, 1.05),
        point("auto", 8, 4.0, 4.0, 4.0),  # alone at batch 8: nothing to compare
        point("recompute", 8, 6.0, 6.0, 6.0) | {"status": "oom"},
    ]
    lines = summary({}, rows, "batch")
    assert lines == [
        "auto at batch 2: 0.99x (0.95-1.02)~ the throughput of plain, the fastest of the 2 "
        "other(s) that train it",
        UNRESOLVED,
    ]


def test_wall_rounds_compare_medians_over_the_rounds_steps() -> None:
    """--rounds: the sizes auto and another strategy train are measured again; each point is
    then its later rounds' median throughput (the search's point left out), its spread their
    fastest and slowest step; a round that did not train is said."""

    def at(strategy: str, batch: int, lo: float, mid: float, hi: float, r: int) -> dict[str, Any]:
        return point(strategy, batch, lo, mid, hi) | {"round": r}

    rows = [
        at("plain", 1, 1.0, 1.0, 1.0, 0),
        at("plain", 2, 1.9, 2.0, 2.1, 0),
        at("sac", 4, 4.0, 4.0, 4.0, 0),
        at("auto", 1, 1.05, 1.1, 1.2, 0),  # the search's point, in a slow hour
        at("auto", 2, 2.0, 2.0, 2.0, 0) | {"status": "oom"},
        at("auto", 4, 4.0, 4.0, 4.0, 0) | {"status": "oom"},
    ]
    assert contested(rows, "batch_size") == {1: ["plain", "auto"]}  # not sac and plain alone
    rows += [at("auto", 1, 0.98, 1.0, 1.01, 1), at("plain", 1, 0.99, 1.0, 1.02, 1)]
    rows += [
        at("plain", 1, 0.97, 1.0, 1.0, 2),
        at("auto", 1, 0.99, 1.0, 1.0, 2) | {"status": "oom"},
    ]
    walls = {"plain": Wall(largest=2), "auto": Wall(largest=1, smallest_failed=2, failed_as="oom")}
    lines = summary(walls, rows, "batch")
    assert lines[1] == "        auto: largest batch 1, 1.00 samples/s there; batch 2: out of memory"
    assert (
        "auto at batch 1: 1 of 2 rounds did not train (oom): its wall is not sharp there" in lines
    )
    assert lines[-2] == (
        "auto at batch 1: 1.00x (0.96-1.04)~ the throughput of plain, the fastest of the 1 "
        "other(s) that train it"
    )
    assert points(rows, "batch_size")[("plain", 1)]["ok_rounds"] == 2


def test_bench_hooks_gives_each_arm_its_rounds() -> None:
    doc = {
        "model": "micro",
        "saved_per_step": 512,
        "device": "cpu",
        "arms": {
            "none": {"step_ms": 6.0, "steps_ms": [5.9, 6.0, 6.4], "x_none": 1.0},
            "noop": {"step_ms": 6.2, "steps_ms": [6.1, 6.2, 6.3], "x_none": 6.2 / 6.0},
            "keep": {"step_ms": 9.0, "steps_ms": [8.8, 9.0, 9.3], "x_none": 1.5},
        },
    }
    text = format_report(doc)
    assert (
        "6.100-6.300" in text and "1.03 (0.95-1.07)~" in text and "1.50 (1.38-1.58)" in text
    )  # < 4 rounds: min-max
    assert text.splitlines()[-1] == UNRESOLVED
    doc["arms"].pop("noop")
    assert UNRESOLVED not in format_report(doc)


def test_bench_hooks_reads_its_rounds_by_their_quartiles() -> None:
    """From four rounds on, one disturbed round (other load) does not widen the range."""
    steady = {"step_ms": 6.0, "steps_ms": [6.0] * 7 + [30.0], "x_none": 1.0}
    keep = {"step_ms": 9.0, "steps_ms": [9.0] * 7 + [40.0], "x_none": 1.5}
    doc = {"model": "micro", "saved_per_step": 8, "device": "cpu"}
    text = format_report(doc | {"arms": {"none": steady, "keep": keep}})
    assert "6.000-6.000" in text and "1.50 (1.50-1.50)" in text and UNRESOLVED not in text


def test_the_predictions_error_counts_the_searchs_points_only() -> None:
    from offloadd.tools.wall.predicted import error_lines

    def row(strategy: str, batch: int, peak: int, predicted: int) -> dict[str, Any]:
        return point(strategy, batch, 1.0, 1.0, 1.0) | {
            "seq_len": 512, "peak_bytes": peak, "predicted_peak_bytes": predicted, "round": 0,
        }  # fmt: skip

    rows = [row("plain", 1, 100, 95), row("auto", 1, 100, 120), row("auto", 2, 100, 118)]
    rows.append(row("auto", 1, 80, 120) | {"round": 1})  # warm where the prediction is cold
    rows.append(row("auto", 4, 100, 90) | {"status": "oom"})
    assert error_lines(rows) == [
        "prediction: within 20.0% of the measured peak at all 3 ok point(s) predicted (worst: "
        "auto at batch 1, seq 512)",
        "  auto batch 1 seq 512: predicted +20.0% off, past the 15% target",
        "  auto batch 2 seq 512: predicted +18.0% off, past the 15% target",
    ]


def test_a_point_above_its_prediction_within_its_slow_disk_peak_is_said_apart() -> None:
    """offload-ssd's second prediction, with ``staging_bytes`` of writes held behind the disk
    (Note [writes behind a slow disk]): a peak between the two is no miss, one past both is."""
    from offloadd.tools.wall.predicted import behind_a_slow_disk, error_lines

    def row(batch: int, peak: int, predicted: int, slow: int | None) -> dict[str, Any]:
        return point("offload-ssd", batch, 1.0, 1.0, 1.0) | {
            "seq_len": 256, "peak_bytes": peak, "predicted_peak_bytes": predicted,
            "predicted_slow_disk_peak_bytes": slow, "round": 0,
        }  # fmt: skip

    rows = [row(16, 100, 95, 130), row(17, 125, 100, 130), row(18, 160, 100, 130)]
    assert [behind_a_slow_disk(r) for r in rows] == [False, True, False]
    assert not behind_a_slow_disk(row(19, 125, 100, None))
    assert error_lines(rows) == [
        "prediction: within 37.5% of the measured peak at all 2 ok point(s) predicted (worst: "
        "offload-ssd at batch 18, seq 256), 1 more within the slow-disk peak",
        "  offload-ssd batch 18 seq 256: predicted -37.5% off, past the 15% target",
        "  offload-ssd batch 17 seq 256: predicted -20.0% off, within the slow-disk peak "
        "(+4.0%): writes were held behind the disk",
    ]
    as_read = {k: str(v) for k, v in rows[1].items()}  # wall.csv read back: strings
    assert behind_a_slow_disk(as_read) and not behind_a_slow_disk(as_read | {"peak_bytes": "99"})
    assert error_lines(rows[1:2])[0] == (
        "prediction: all 1 ok point(s) predicted within the slow-disk peak"
    )
