"""What the P/D decode pod's slow inter-token gaps are made of (``bench/pd.py --trace DIR``).

The decode daemon runs with ``PAGEFLEET_STEP_TRACE`` (pagefleet/daemon/step_trace.py): one
line per engine step (calls served before it, its start and end, decode rows, prefill rows
and tokens) and one per KV import (start, reserved, pulled, written, committed). This
module lines them up with the client's token arrival times of the same run (one clock:
CLOCK_MONOTONIC) and says:

- engine side: the interval between consecutive step ends, weighted by the decode rows of
  the later step (each such row is one stream's gap), split into calls served between the
  steps, the step itself, and the rest (outputs sent, the wait for the next call batch);
  each interval classed as ``admit`` (the step prefilled new prompts: a chat's next turn),
  ``import`` (reserve / write_import / commit_import calls before it), both, or ``plain``;
- client side: each chat gap at or over the client's p99, attributed to the steps whose
  ends fall between its two tokens' arrivals: the engine's share (the span of those step
  ends) and the delivery's (the rest: the HTTP process's SSE on the same core);
- the imports' phases, and each long prompt's first token after its commit.
"""

from __future__ import annotations

import bisect
import itertools
import json
from pathlib import Path
from typing import Any

_IMPORT_CALLS = frozenset({"reserve_import", "write_import", "commit_import"})
_BUCKETS_MS = (20, 30, 40, 50, 60, 80, 100, 150)


def _load(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wpct(pairs: list[tuple[float, int]], q: float) -> float:
    """Weighted quantile of (value, weight) pairs."""
    pairs = sorted(p for p in pairs if p[1] > 0)
    total = sum(w for _, w in pairs)
    if not total:
        return float("nan")
    acc = 0
    for v, w in pairs:
        acc += w
        if acc >= q * total:
            return v
    return pairs[-1][0]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _cls(step: dict[str, Any]) -> str:
    imp = any(c in _IMPORT_CALLS for c in step["calls"])
    adm = step["pf"] > 0
    return "admit+import" if imp and adm else "import" if imp else "admit" if adm else "plain"


def _bucket(ms: float) -> str:
    for b in _BUCKETS_MS:
        if ms < b:
            return f"<{b}"
    return f">={_BUCKETS_MS[-1]}"


def analyse(trace_dir: str, result: Any) -> dict[str, Any]:
    """The breakdown of ``result`` (bench/pd.py's Result of the P/D fleet's run) from the
    decode pod's trace files in ``trace_dir``."""
    base = Path(trace_dir) / "decode"
    lo, hi = result.span
    steps = [s for s in _load(base) if lo <= s["t2"] <= hi]
    imports = [r for r in _load(Path(str(base) + ".imports")) if lo <= r["t"][0] <= hi]
    out: dict[str, Any] = {"steps": len(steps), "imports": len(imports)}
    if len(steps) < 2:
        return out
    # Engine side: intervals between step ends, one stream gap per decode row.
    rows = []
    for prev, s in itertools.pairwise(steps):
        iv = (s["t2"] - prev["t2"]) * 1e3
        step_ms = (s["t2"] - s["t1"]) * 1e3
        calls_ms = (s["t1"] - s["t0"]) * 1e3 if s["calls"] else 0.0
        rows.append((iv, s["dec"], _cls(s), step_ms, calls_ms, iv - step_ms - calls_ms, s))
    pairs = [(r[0], r[1]) for r in rows]
    p99 = _wpct(pairs, 0.99)
    eng = {
        "gaps": sum(r[1] for r in rows),
        "p50_ms": round(_wpct(pairs, 0.5), 1),
        "p90_ms": round(_wpct(pairs, 0.9), 1),
        "p99_ms": round(p99, 1),
        "p999_ms": round(_wpct(pairs, 0.999), 1),
    }
    classes: dict[str, dict[str, float]] = {}
    for iv, w, c, step_ms, calls_ms, other_ms, s in rows:
        d = classes.setdefault(
            c, {"steps": 0, "gaps": 0, "gaps_ge_p99": 0, "step_ms": 0.0, "calls_ms": 0.0,
                "other_ms": 0.0, "dec": 0.0, "pft": 0.0, "interval_ms": 0.0}
        )  # fmt: skip
        d["steps"] += 1
        d["gaps"] += w
        d["step_ms"] += step_ms
        d["calls_ms"] += calls_ms
        d["other_ms"] += other_ms
        d["dec"] += s["dec"]
        d["pft"] += s["pft"]
        d["interval_ms"] += iv
        if iv >= p99:
            d["gaps_ge_p99"] += w
    for d in classes.values():
        n = d["steps"]
        for k in ("step_ms", "calls_ms", "other_ms", "dec", "pft", "interval_ms"):
            d[k] = round(d[k] / n, 1)
    eng["by_class"] = classes
    hist: dict[str, dict[str, int]] = {}
    for iv, w, c, *_ in rows:
        h = hist.setdefault(_bucket(iv), {})
        h[c] = h.get(c, 0) + w
    eng["histogram_gaps"] = {b: hist[b] for b in sorted(hist, key=_bucket_key)}
    top = sorted((r for r in rows if r[0] >= p99), key=lambda r: -r[0])
    eng["slowest"] = [
        {"interval_ms": round(r[0], 1), "class": r[2], "step_ms": round(r[3], 1),
         "calls_ms": round(r[4], 1), "other_ms": round(r[5], 1), "dec": r[6]["dec"],
         "pft": r[6]["pft"], "calls": r[6]["calls"]}
        for r in top[:12]
    ]  # fmt: skip
    out["engine"] = eng
    # Client side: each gap >= the client's p99, split into the engine's span (between the
    # step ends before its two tokens' arrivals) and the delivery's rest.
    ends = [s["t2"] for s in steps]
    gaps = [(b - a, a, b) for t in result.streams for a, b in itertools.pairwise(t)]
    gaps = [g for g in gaps if lo <= g[1] and g[2] <= hi]
    cp99 = _pct([g[0] for g in gaps], 0.99)
    slow = [g for g in gaps if g[0] >= cp99]
    spans, engine_ms, deliver_ms, cls_count = [], [], [], {}
    for gap, a, b in slow:
        j = bisect.bisect_right(ends, a) - 1
        k = bisect.bisect_right(ends, b) - 1
        if j < 0 or k <= j:
            spans.append(0)
            engine_ms.append(0.0)
            deliver_ms.append(gap * 1e3)
            cls_count["no step"] = cls_count.get("no step", 0) + 1
            continue
        spans.append(k - j)
        e = (ends[k] - ends[j]) * 1e3
        engine_ms.append(e)
        deliver_ms.append(gap * 1e3 - e)
        kinds = {_cls(steps[i]) for i in range(j + 1, k + 1)} - {"plain"}
        key = "+".join(sorted(kinds)) or "plain"
        cls_count[key] = cls_count.get(key, 0) + 1
    n = max(len(slow), 1)
    out["client"] = {
        "gaps": len(gaps),
        "p50_ms": round(_pct([g[0] for g in gaps], 0.5) * 1e3, 1),
        "p99_ms": round(cp99 * 1e3, 1),
        "ge_p99": len(slow),
        "ge_p99_steps_spanned": {str(k): spans.count(k) for k in sorted(set(spans))},
        "ge_p99_engine_ms_mean": round(sum(engine_ms) / n, 1),
        "ge_p99_delivery_ms_mean": round(sum(deliver_ms) / n, 1),
        "ge_p99_by_steps_within": cls_count,
    }
    # Imports: phases (ms) and the first token after the commit (matched in time order).
    # An early import's ``wait`` (for the handle, after its reservation) overlaps the
    # prefill: not a cost of its own.
    ph: dict[str, list[float]] = {
        "reserve": [], "wait": [], "pull": [], "write_pieces": [], "commit": [],
        "to_first_token": [],
    }  # fmt: skip
    firsts = sorted(sent + ttft for sent, ttft, _ in result.long_sent)
    for r in imports:
        t = _import_times(r)
        if t is None:
            continue
        ph["reserve"].append((t["reserved"] - t["start"]) * 1e3)
        if "ready" in t:
            ph["wait"].append((t["ready"] - t["reserved"]) * 1e3)
        ph["pull"].append((t["pulled"] - t.get("ready", t["reserved"])) * 1e3)
        ph["write_pieces"].append((t["written"] - t["pulled"]) * 1e3)
        ph["commit"].append((t["committed"] - t["written"]) * 1e3)
        i = bisect.bisect_left(firsts, t["committed"])
        if i < len(firsts):
            ph["to_first_token"].append((firsts[i] - t["committed"]) * 1e3)
    out["import_ms"] = {
        k: {
            "p50": round(_pct(v, 0.5), 1),
            "max": round(max(v), 1),
            "mean": round(sum(v) / len(v), 1),
        }
        for k, v in ph.items()
        if v
    }
    return out


# A step that prefilled at least this many tokens ran a long prompt (the bench's are
# 1536-2047 tokens; a chat's turn is 32).
_LONG_PREFILL = 1000
_PHASES_PD = ("queue_long", "queue_other", "gateway_in", "compute", "gather", "hand_over",
              "reserve", "pull", "write", "commit", "to_first_token")  # fmt: skip
_PHASES_UNIFIED = ("queue_long", "queue_other", "gateway_in", "compute", "to_first_token")


def _overlap(steps: list[dict[str, Any]], lo: float, hi: float, skip: Any) -> float:
    """Seconds of ``steps`` (t1..t2) inside [lo, hi], those whose id is in ``skip`` excluded."""
    return sum(max(0.0, min(s["t2"], hi) - max(s["t1"], lo)) for s in steps if id(s) not in skip)


def _long_requests(
    per_engine: dict[str, list[dict[str, Any]]],
) -> list[tuple[float, str, str, int, list[dict[str, Any]]]]:
    """Every long prompt the engines prefilled, from the steps' ``pr`` rows: (its first
    step's start, engine, request id, prompt length, its steps in order), by start. A step
    shared by two prompts (the end of one, the start of the next) is in both lists."""
    found: dict[tuple[str, str], tuple[int, list[dict[str, Any]]]] = {}
    for name, steps in per_engine.items():
        for s in steps:
            for rid, _start, _ntok, plen in s.get("pr", ()):
                if plen >= _LONG_PREFILL:
                    found.setdefault((name, rid), (plen, []))[1].append(s)
    return sorted((ss[0]["t1"], name, rid, plen, ss) for (name, rid), (plen, ss) in found.items())


def _import_times(r: dict[str, Any]) -> dict[str, float] | None:
    """An import line's times by name (``ready``: a pending import's wait for the handle
    ended), or None for an import that did not commit."""
    t = r["t"]
    names = ("start", "reserved", "ready", "pulled", "written", "committed")
    if not r.get("pending"):
        names = ("start", "reserved", "pulled", "written", "committed")
    return dict(zip(names, t, strict=True)) if len(t) == len(names) else None


def long_phases(trace_dir: str, result: Any, fleet: str) -> dict[str, Any]:
    """Where each long prompt's TTFT went (ms), from the traced daemons' step lines (and
    the decode pod's import lines) and the client's send times and TTFTs in ``result``:

    - ``queue_long``: the engine that prefilled it ran other long prompts' prefill steps
      after it was sent (it waited behind them), ``queue_other``: other steps (decodes,
      chats' turns), ``gateway_in``: the rest before its first step started (client,
      gateway, the daemon's HTTP side, engine call);
    - ``compute``: its first prefill step's start to its last one's end (a step it shares
      with another long prompt counts for both); ``gather`` (P/D): the export stage's fill;
    - P/D: ``hand_over`` (gather end to the decode pod's import start: the prefill pod's
      response, the gateway, the decode pod's HTTP side; for an early import -- sent while
      the prefill ran -- gather end to the end of its wait for the handle), the import's
      ``reserve`` (an early import's only as far as it ran past the gather's end),
      ``pull``, ``write``, ``commit``; ``to_first_token``: the rest to the client's first
      token (on P/D the decode pod's step for the last prompt token, and the way back).
      ``reserve_early_ms`` and ``early`` say how long early reservations took beside the
      prefill, and how many imports were early.

    ``fleet``: "pd" (prefill pod ``prefill``, decode pod ``decode``) or "unified" (``u0``,
    ``u1``). Prompts are matched to the engine requests that prefilled them in send order,
    by prompt length (the steps' ``pr`` rows, so two prompts in one step both match), and
    on P/D to the decode pod's import of the same handle."""
    base = Path(trace_dir)
    names = ["prefill"] if fleet == "pd" else ["u0", "u1"]
    per_engine = {n: _load(base / n) for n in names}
    reqs = _long_requests(per_engine)
    imports = _load(base / "decode.imports") if fleet == "pd" else []
    by_handle = {r["handle"]: r for r in imports if r.get("handle")}
    used: set[int] = set()
    rows: list[dict[str, float]] = []
    unmatched = shared = early = 0
    reserve_early: list[float] = []
    for sent, ttft, n in sorted(result.long_sent):
        if ttft != ttft:  # NaN: no token came
            continue
        hit = next(
            (i for i, r in enumerate(reqs) if i not in used and r[3] == n and r[0] >= sent),
            None,
        )
        if hit is None:
            unmatched += 1
            continue
        used.add(hit)
        _, eng, rid, _, mine = reqs[hit]
        first_step, last_step = mine[0], mine[-1]
        first = sent + ttft
        others = per_engine[eng]
        skip = {id(s) for s in mine}
        longs = [s for s in others if any(r[3] >= _LONG_PREFILL for r in s.get("pr", ()))]
        q_long = _overlap(longs, sent, first_step["t1"], skip)
        q_all = _overlap(others, sent, first_step["t1"], skip)
        shared += any(sum(r[3] >= _LONG_PREFILL for r in s.get("pr", ())) > 1 for s in mine)
        row = {
            "ttft": ttft,
            "queue_long": q_long,
            "queue_other": q_all - q_long,
            "gateway_in": first_step["t1"] - sent - q_all,
            "compute": last_step["t2"] - first_step["t1"],
        }
        if fleet == "pd":
            end = last_step.get("t3", last_step["t2"])
            row["gather"] = end - last_step["t2"]
            imp = by_handle.get(rid)
            t = None if imp is None else _import_times(imp)
            if t is None:  # prefilled on the decode pod after all (fallback)
                unmatched += 1
                continue
            if "ready" in t:  # early: reserved beside the prefill, then waited for it
                early += 1
                reserve_early.append(t["reserved"] - t["start"])
                past = max(end, t["reserved"])
                row.update(reserve=past - end, hand_over=t["ready"] - past,
                           pull=t["pulled"] - t["ready"])  # fmt: skip
            else:
                row.update(hand_over=t["start"] - end, reserve=t["reserved"] - t["start"],
                           pull=t["pulled"] - t["reserved"])  # fmt: skip
            row.update(
                write=t["written"] - t["pulled"], commit=t["committed"] - t["written"],
                to_first_token=first - t["committed"],
            )  # fmt: skip
        else:
            row["to_first_token"] = first - last_step["t2"]
        rows.append(row)
    out: dict[str, Any] = {"prompts": len(rows), "unmatched": unmatched, "shared_step": shared}
    if not rows:
        return out
    out["ttft_ms"] = {
        "p50": round(_pct([r["ttft"] for r in rows], 0.5) * 1e3, 1),
        "p90": round(_pct([r["ttft"] for r in rows], 0.9) * 1e3, 1),
        "p99": round(_pct([r["ttft"] for r in rows], 0.99) * 1e3, 1),
        "mean": round(sum(r["ttft"] for r in rows) / len(rows) * 1e3, 1),
    }
    phases = _PHASES_PD if fleet == "pd" else _PHASES_UNIFIED
    out["phases_ms"] = {
        k: {
            "p50": round(_pct([r[k] for r in rows], 0.5) * 1e3, 1),
            "mean": round(sum(r[k] for r in rows) / len(rows) * 1e3, 1),
            "max": round(max(r[k] for r in rows) * 1e3, 1),
        }
        for k in phases
    }
    if fleet == "pd":  # the phases a unified daemon does not have, plus its first token
        out["after_compute_ms_mean"] = round(
            sum(out["phases_ms"][k]["mean"] for k in _PHASES_PD[4:]), 1
        )
        out["early"] = early
        if reserve_early:
            out["reserve_early_ms"] = {
                "p50": round(_pct(reserve_early, 0.5) * 1e3, 1),
                "mean": round(sum(reserve_early) / len(reserve_early) * 1e3, 1),
            }
    if fleet == "unified":
        out["per_engine"] = {n: sum(1 for i in used if reqs[i][1] == n) for n in names}
    return out


def _bucket_key(b: str) -> float:
    return float(b.lstrip("<>=")) + (0.5 if b.startswith(">") else 0.0)


def render(rep: dict[str, Any]) -> str:
    """A few readable lines of ``analyse``'s result (for stderr)."""
    lines = [f"decode trace: {rep.get('steps')} steps, {rep.get('imports')} imports"]
    eng = rep.get("engine")
    if eng:
        lines.append(
            f"  engine gaps p50/p90/p99/p99.9 {eng['p50_ms']}/{eng['p90_ms']}/{eng['p99_ms']}/"
            f"{eng['p999_ms']} ms over {eng['gaps']}"
        )
        for c, d in sorted(eng["by_class"].items()):
            lines.append(f"  {c:13s} {d}")
        for b, h in eng["histogram_gaps"].items():
            lines.append(f"  gap {b:>6s} ms: {h}")
        for s in eng["slowest"]:
            lines.append(f"  slow {s}")
    if "client" in rep:
        lines.append(f"  client {rep['client']}")
    if "import_ms" in rep:
        lines.append(f"  imports {rep['import_ms']}")
    return "\n".join(lines)
