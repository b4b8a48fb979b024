"""Where each request's TTFT went: the client's stamps joined to the daemon's request log.

Every door (pagefleet's gateway or a peer router) sends the same prompts to the same
daemons, each started with ``--request-log`` (pagefleet/daemon/request_log.py). A request
is joined to the daemon's line by its prompt's fingerprint; the times are all
CLOCK_MONOTONIC on one machine, so they subtract. Per request:

- ``door_in``: client send -> the daemon's HTTP handler (the front door's own work, its
  proxy hop, connection set-up; for a peer, whatever it does before forwarding);
- ``daemon_pre``: handler -> engine (parse, chat template, tokenize in the daemon);
- ``queue``: engine arrival -> first scheduled;
- ``prefill``: first scheduled -> first token (this prompt's uncached tokens, and the
  steps it shared with other requests on the same daemon);
- ``door_out``: first token in the engine -> first content chunk at the client (the
  engine's output path, the daemon's SSE write, the door's relay);
- ``ahead``: uncached prompt tokens of the other requests on the same pod that had
  arrived and not yet got their first token when this one arrived (the queue placement
  put it behind);
- ``co_prefill``: uncached tokens of requests on *other* pods whose prefill overlapped
  this one's (on a machine whose daemons share CPU cores, they slow each other).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from pagefleet.daemon.request_log import prompt_fingerprint
from pagefleet.dev.loadgen import RequestResult

PARTS = ("door_in", "daemon_pre", "queue", "prefill", "door_out")


def read_trace(path: Path, pos: int) -> tuple[list[dict[str, Any]], int]:
    """Lines appended since byte ``pos``, and the new end position."""
    if not path.exists():
        return [], pos
    with path.open("rb") as f:
        f.seek(pos)
        data = f.read()
    # A line being written has no newline yet: leave it for the next read.
    end = data.rfind(b"\n") + 1
    lines = [json.loads(x) for x in data[:end].splitlines() if x.strip()]
    return lines, pos + end


def join(
    results: list[RequestResult],
    ids: dict[tuple[int, int], list[int]],
    trace: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """One row per successful request found in ``trace`` (the lines of this door's run)."""
    by_fp: dict[str, dict[str, Any]] = {}
    for line in trace:
        if line.get("first_token") is not None and line.get("scheduled") is not None:
            by_fp[line["fp"]] = line
    rows: list[dict[str, Any]] = []
    for r in results:
        if not r.ok:
            continue
        d = by_fp.get(prompt_fingerprint(ids[(r.conversation, r.turn)]))
        if d is None:
            continue
        first = r.start + r.ttft
        rows.append(
            {
                "conv": r.conversation,
                "turn": r.turn,
                "pod": d["pod"],
                "prompt": d["prompt"],
                "cached": d["cached"],
                "ttft": r.ttft * 1000,
                "door_in": (d["http"] - r.start) * 1000,
                "daemon_pre": (d["arrival"] - d["http"]) * 1000,
                "queue": (d["scheduled"] - d["arrival"]) * 1000,
                "prefill": (d["first_token"] - d["scheduled"]) * 1000,
                "door_out": (first - d["first_token"]) * 1000,
                "_d": d,
            }
        )
    lines = list(by_fp.values())
    for row in rows:
        d = row.pop("_d")
        ahead = co = 0
        for o in lines:
            if o is d:
                continue
            work = o["prompt"] - o["cached"]
            if o["pod"] == d["pod"]:
                if o["arrival"] <= d["arrival"] < o["first_token"]:
                    ahead += work
            elif o["scheduled"] < d["first_token"] and d["scheduled"] < o["first_token"]:
                co += work
        row["ahead"] = ahead
        row["co_prefill"] = co
    return rows


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 1) if xs else None


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per class: ``hit`` (at least half the prompt cached) and ``miss``."""
    out: dict[str, Any] = {}
    for cls, sel in (
        ("hit", [r for r in rows if r["cached"] * 2 >= r["prompt"]]),
        ("miss", [r for r in rows if r["cached"] * 2 < r["prompt"]]),
    ):
        out[cls] = {"n": len(sel)} | {
            k: _median([r[k] for r in sel])
            for k in ("ttft", *PARTS, "ahead", "co_prefill", "cached")
        }
    return out
