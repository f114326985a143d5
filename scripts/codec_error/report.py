"""The report: the markdown page of a run's results (its JSON)."""

from __future__ import annotations

import math
from typing import Any

from offloadd.codec import DEFAULT_OPS

from .common import DENIED
from .ops import SMALL_GROUP, expand_cases


def _e(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x) or math.isnan(x):
        return "inf" if math.isinf(x) else "nan"
    return "0" if x == 0 else f"{x:.2e}"


def _r(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    if math.isinf(xs[hi]) or math.isinf(xs[lo]):
        return xs[hi]
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def markdown(res: dict[str, Any], notes: str = "") -> str:
    meta = res["meta"]
    codecs: list[str] = meta["codecs"]
    lossy = [c for c in codecs if c != "none"]
    L: list[str] = []
    w = L.append
    w(
        f"# Codec error: gradients with lossy saved activations, {meta['machine_tag']}, {meta['date']}"
    )
    w("")
    w(
        f"Machine: {meta['machine']}, {meta['cpus']} CPUs (other work ran at the same time: "
        f"timings are indicative only), torch {meta['torch']}, transformers "
        f"{meta['transformers']}, Python {meta['python']}. Produced by `scripts/codec_error/` "
        f"(this file and the JSON next to it are written by the script; numbers are its own):"
    )
    w("")
    w("```sh")
    w(meta["command"])
    w("```")
    w("")
    start, end = meta.get("code_sha256_start", {}), meta.get("code_sha256_end", {})
    if start:
        w(
            "Code measured (sha256 prefixes; the tree was being edited by other work, so these "
            "identify the version): " + ", ".join(f"`{f}` {h}" for f, h in start.items()) + "."
        )
        if end and end != start:
            changed = sorted(f for f in set(start) | set(end) if start.get(f) != end.get(f))
            w(
                "**These files changed while the script ran** (the numbers are from the code "
                "imported at the start, unless a module was imported later): "
                + ", ".join(f"`{f}`" for f in changed)
                + "."
            )
        w("")
    w(
        f"Total runtime {meta['seconds']:.0f} s (op corpus {res['ops']['seconds']:.0f} s). "
        "Codec settings are the defaults (`codec_group=256`, symmetric int8, round to nearest) "
        "and tier `keep` (the codec is the same on every tier: [codes through the tiers])."
    )
    w("")
    w(
        "Errors: `rel L2 = ||g_codec - g|| / ||g||`, `max = max|g_codec - g| / max|g|` over all "
        "the gradients of a case concatenated (elements where the reference is not finite left "
        "out; `inf`: the codec produced a NaN or infinity where the reference had none). The "
        "reference is the same computation without offloadd, checked to be bit-reproducible "
        "(a second plain run); `none` under offloadd must be exactly 0."
    )
    w("")

    # models
    w("## Models (random weights, one training step)")
    w("")
    w(
        "All parameter gradients of one forward + backward (loss from the model's own head). "
        "Training mode with every dropout probability 0, so that plain and coded runs are "
        "deterministic and comparable (dropout masks would differ otherwise); with dropout "
        "`scaled_dot_product_attention` is also left exact (allowlist.py). Default allow list, default "
        "`codec_min_bytes` (64 KiB). `saved` = `stats().saved_bytes` with the codec / without "
        "(tier keep; counts views each time and parameters saved by ops, and a coded storage "
        "saved twice once); `peak` = `peak_resident_bytes` ratio (activation memory held, "
        "parameters not counted); `coded out/in` = `coded_out_bytes / coded_in_bytes`; "
        "`worst param` = the parameter with the largest rel L2 of its own."
    )
    w("")
    for row in res["models"]:
        det = "" if row["deterministic"] else " **(reference NOT reproducible)**"
        tiny = row.get("negligible_grad_params", [])
        left = (
            "; left out of `worst param` as their exact gradient is ~0 (rms below 1e-4 of all): "
            + ", ".join(f"`{n}`" for n in tiny)
            if tiny
            else ""
        )
        w(f"- **{row['model']}**: {row['what']}; {row['parameters']:,} parameters{det}{left}.")
    w("")
    w(
        "| model | codec | rel L2 | max | worst param (rel L2) | coded tensors | coded out/in "
        "| saved | peak |"
    )
    w("|---|---|---|---|---|---|---|---|---|")
    for row in res["models"]:
        for c in codecs:
            v = row["codecs"][c]
            same = "" if v["loss_identical"] else " (loss differs!)"
            worst = f"`{v['worst_param']}` {_e(v['worst_param_rel_l2'])}" if v["rel_l2"] else "-"
            coded_ratio = _r(v["coded_ratio"]) if v["coded_tensors"] else "-"
            w(
                f"| {row['model']} | {c}{same} | {_e(v['rel_l2'])} | {_e(v['max_rel'])} | "
                f"{worst} | {v['coded_tensors']} | {coded_ratio} | {_r(v['saved_ratio'])} | "
                f"{_r(v['peak_ratio'])} |"
            )
    w("")

    # probes
    w("## Probes: allowed ops on inputs that are hard for per-group ranges")
    w("")
    w(
        "Random-weight models have well-scaled activations; trained ones do not (outlier "
        "channels, large offsets, peaky attention). Each probe: one allowed op, default allow "
        "list and `codec_min_bytes`, gradients of its inputs (and parameters) for a random "
        "cotangent; rel L2 (max) per codec; `coded`: tensors coded, per codec in the order of "
        "the columns. Shapes: "
        + ("(2, 32, 256)" if meta["quick"] else "(4, 128, 256)")
        + " for layer norm and linear (`nn.LayerNorm` and `nn.Linear`: their parameters are never "
        "coded), 4 heads for softmax and attention."
    )
    w("")
    w("| probe | coded | " + " | ".join(lossy) + " |")
    w("|---|---|" + "---|" * len(lossy))
    for p in res["probes"]:
        cells = [f"{_e(p['codecs'][c]['rel_l2'])} ({_e(p['codecs'][c]['max_rel'])})" for c in lossy]
        coded = "/".join(str(p["codecs"][c]["coded_tensors"]) for c in lossy)
        w(f"| {p['probe']} | {coded} | " + " | ".join(cells) + " |")
    w("")

    # op corpus
    ops = res["ops"]
    cases = expand_cases(ops)
    by = {(c["op"], c["codec"], c["mode"]): c for c in cases}
    names = sorted(set(ops.get("forced_codec_ops", {})) | {c["op"] for c in cases})
    w("## Op corpus (`op_db`)")
    w("")
    skips = ops["skipped_ops"]
    w(
        f"{ops['ops_considered']} OpInfos of `op_db` have autograd and a float32 backward on CPU; "
        f"{len(names)} had at least one usable sample, {len(skips)} were skipped (reasons in the "
        f"JSON: `skipped_ops`). At most {meta['max_samples']} float32 samples per op (the first "
        "ones, as PyTorch generates them from seed 0); each op's error is the worst of its "
        "samples. Cotangent: a fixed `randn` per output. Every mode uses `codec_min_bytes=1` (the "
        "corpus's tensors are tiny: with the default 64 KiB nothing would be coded)."
    )
    reasons: dict[str, int] = {}
    for why in skips.values():
        key = why.split(":")[0]
        reasons[key] = reasons.get(key, 0) + 1
    if reasons:
        w("")
        w(
            "Skipped ops by reason: "
            + "; ".join(f"{k}: {n}" for k, n in sorted(reasons.items()))
            + "."
        )
    if ops["skipped_samples_by_reason"]:
        w(
            "Skipped samples (of ops otherwise counted or not) by reason: "
            + "; ".join(f"{k}: {n}" for k, n in sorted(ops["skipped_samples_by_reason"].items()))
            + "."
        )
    failed = [c for c in cases if c["failures"]]
    w("")
    if failed:
        w("**Runs that failed under the codec** (exception, or a forward output that changed):")
        w("")
        for c in failed:
            w(f"- `{c['op']}` {c['codec']} {c['mode']}: {'; '.join(sorted(set(c['failures'])))}")
    else:
        w("No run raised under a codec and no forward output changed.")
    w("")
    if "none" in codecs:
        nonzero = [n for n in names if (by.get((n, "none", "default")) or {}).get("rel_l2")]
        w(
            "Codec `none` under offloadd: "
            + (
                "error exactly 0 for every op."
                if not nonzero
                else f"**nonzero error for {', '.join(nonzero)}**."
            )
        )
        w("")

    # default mode
    w("### Default allow list: what users get")
    w("")
    coded_default = [
        n
        for n in names
        if any((by.get((n, c, "default")) or {}).get("coded_tensors", 0) for c in lossy)
    ]
    moved = [
        n
        for n in names
        if n not in coded_default
        and any((by.get((n, c, "default")) or {}).get("rel_l2", 0) for c in lossy)
    ]
    w(
        f"{len(coded_default)} of {len(names)} ops had a saved tensor coded; every other op's "
        + (
            "gradients were unchanged (error exactly 0)."
            if not moved
            else f"gradients were unchanged except **{', '.join(moved)}** (changed with nothing coded!)."
        )
        + " Per coded op: rel L2 (max), worst sample; `n` = tensors coded per sample run, int8 "
        "(a tensor is coded only where its codes and ranges are smaller than it, so int4 and "
        "int2 take a few more small ones); `not coded`: nothing of that op was coded with that "
        "codec."
    )
    w("")
    w(
        "`allowed called`: the allow list's functions among those the op's forward called at the "
        "outermost level, which is what the list is matched against (an op_db entry that is a "
        "Python function not dispatched as a torch function for plain tensors, such as "
        "`torch.masked.*` or `pca_lowrank`, exposes the functions it calls)."
    )
    w("")
    w("| op | allowed called | n | " + " | ".join(lossy) + " |")
    w("|---|---|---|" + "---|" * len(lossy))
    outer = ops.get("forced_codec_ops", {})
    for n in coded_default:
        first = by.get((n, lossy[0], "default")) or {}
        per = first.get("coded_tensors", 0) / max(first.get("samples", 1), 1)
        shown = ", ".join(f for f in outer.get(n, []) if f in DEFAULT_OPS)
        cells = []
        for c in lossy:
            v = by.get((n, c, "default"))
            cells.append(
                "not coded"
                if v is None or not v["coded_tensors"]
                else f"{_e(v['rel_l2'])} ({_e(v['max_rel'])})"
            )
        w(f"| `{n}` | {shown} | {per:.1f} | " + " | ".join(cells) + " |")
    w("")

    # forced mode
    w("### Forced: every floating saved tensor with an argument's shape coded")
    w("")
    w(
        "`codec_ops` = the torch functions the op's forward calls at the outermost level "
        "(recorded per op, normally just the op's own function; JSON: `forced_codec_ops`), so "
        "the op's saved inputs and outputs are coded whatever the allow list says. This is each "
        "op's sensitivity, not what users get. Distribution of rel L2 over the ops where at "
        "least one tensor was coded (`inf` counts as above every threshold):"
    )
    w("")
    modes = ["forced"] + (["forced-g16"] if any(c["mode"] == "forced-g16" for c in cases) else [])
    w("| codec | mode | ops coded | median | p90 | max | ≥ 1e-2 | ≥ 1e-1 | ≥ 1 | inf/NaN |")
    w("|---|---|---|---|---|---|---|---|---|---|")
    for c in lossy:
        for mode in modes:
            errs = [
                by[(n, c, mode)]["rel_l2"]
                for n in names
                if (n, c, mode) in by and by[(n, c, mode)]["coded_tensors"]
            ]
            if not errs:
                w(f"| {c} | {mode} | 0 | - | - | - | - | - | - | - |")
                continue
            w(
                f"| {c} | {mode} | {len(errs)} | {_e(_quantile(errs, 0.5))} | "
                f"{_e(_quantile(errs, 0.9))} | {_e(max(errs))} | {sum(e >= 1e-2 for e in errs)} | "
                f"{sum(e >= 1e-1 for e in errs)} | {sum(e >= 1 for e in errs)} | "
                f"{sum(math.isinf(e) or math.isnan(e) for e in errs)} |"
            )
    w("")
    if "forced-g16" in modes:
        w(
            f"`forced-g16`: the same with `codec_group={SMALL_GROUP}`. op_db's tensors are mostly "
            "smaller than a group of 256 values, and a tensor is coded only where its codes and "
            "ranges are smaller than it, so at the default group many ops code nothing; smaller "
            "groups code them, with tighter ranges (so smaller errors than the default group "
            "would give on the same values)."
        )
        w("")
    top = 15
    for mode in modes:
        for c in lossy:
            ranked = sorted(
                (
                    by[(n, c, mode)]
                    for n in names
                    if (n, c, mode) in by and by[(n, c, mode)]["coded_tensors"]
                ),
                key=lambda v: -v["rel_l2"] if not math.isnan(v["rel_l2"]) else -math.inf,
            )[:top]
            w(
                f"Worst {len(ranked)} ops, {c}, {mode}: "
                + ", ".join(
                    f"`{v['op']}` {_e(v['rel_l2'])}" + (" (allowed)" if _allowed(v["op"]) else "")
                    for v in ranked
                )
                + "."
            )
            w("")
    w(
        "The ops that allowlist.py leaves out on purpose, forced: rel L2 (max)"
        + (", then rel L2 of `forced-g16`" if "forced-g16" in modes else "")
        + ":"
    )
    w("")
    w("| op | " + " | ".join(lossy) + " |")
    w("|---|" + "---|" * len(lossy))
    for n in names:
        if n.split(".")[0] in DENIED or n in DENIED:
            cells = []
            for c in lossy:
                parts = []
                for mode in modes:
                    v = by.get((n, c, mode))
                    if v is None or not v["coded_tensors"]:
                        parts.append("not coded")
                    elif mode == "forced":
                        parts.append(f"{_e(v['rel_l2'])} ({_e(v['max_rel'])})")
                    else:
                        parts.append(_e(v["rel_l2"]))
                cells.append(" / ".join(parts))
            w(f"| `{n}` | " + " | ".join(cells) + " |")
    w("")
    if notes:
        w("## Conclusions")
        w("")
        w(notes.strip())
        w("")
    return "\n".join(L)


def _allowed(op: str) -> bool:
    """Whether an op_db name is one of the allow list's functions (``softmax.with_dtype``)."""
    return op.removeprefix("nn.functional.").split(".")[0] in DEFAULT_OPS
