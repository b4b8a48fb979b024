"""The opt-in step trace (pagefleet/daemon/step_trace.py) and bench/pd_trace.py's reading of it:
a traced engine writes one line per step with its rows, and the analysis classes each
interval and splits a slow client gap into the engine's span and the delivery's rest."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagefleet.daemon.step_trace import ENV, ImportTrace, StepTrace

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pd_trace():
    spec = importlib.util.spec_from_file_location("pd_trace", ROOT / "bench/pd_trace.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["pd_trace"] = mod
    spec.loader.exec_module(mod)
    return mod


@dataclass
class _Row:
    num_new_tokens: int
    start: int = 0

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1

    @property
    def seq(self) -> SimpleNamespace:  # a prompt of exactly this row's tokens
        req = SimpleNamespace(request_id=f"p{self.num_new_tokens}")
        return SimpleNamespace(request=req, num_prompt_tokens=self.num_new_tokens)


@dataclass
class _Sched:
    plan: list[list[int]]
    calls: int = 0

    def schedule(self) -> SimpleNamespace:
        rows = self.plan[self.calls]
        self.calls += 1
        return SimpleNamespace(scheduled=[_Row(n) for n in rows])


@dataclass
class _Result:
    span: tuple[float, float]
    streams: list[list[float]] = field(default_factory=list)
    long_sent: list[tuple[float, float, int]] = field(default_factory=list)


def test_off_without_the_variable(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    sched = _Sched([[1]])
    engine = SimpleNamespace(scheduler=sched)
    assert StepTrace.from_env(engine) is None
    assert ImportTrace.from_env() is None
    assert engine.scheduler.schedule == sched.schedule  # nothing wrapped


def test_trace_lines_and_their_breakdown(tmp_path, monkeypatch, pd_trace):
    base = tmp_path / "decode"
    monkeypatch.setenv(ENV, str(base))
    # Four steps: plain, one with a 3 x 32-token admission, one after an import call, plain.
    sched = _Sched([[1, 1], [1, 1, 32, 32, 32], [1, 1], [1, 1]])
    engine = SimpleNamespace(scheduler=sched)
    trace = StepTrace.from_env(engine)
    assert trace is not None
    ends = [1.000, 1.020, 1.065, 1.095, 1.115]
    for i, (a, b) in enumerate(itertools.pairwise(ends)):
        if i == 2:
            trace.calls(a + 0.001, ["write_import"])
        engine.scheduler.schedule()
        trace.step(a + 0.002, b)
    trace.flush()
    lines = [json.loads(x) for x in base.read_text().splitlines()]
    assert [(x["dec"], x["pf"], x["pft"]) for x in lines] == [
        (2, 0, 0), (2, 3, 96), (2, 0, 0), (2, 0, 0)
    ]  # fmt: skip
    assert lines[2]["calls"] == ["write_import"] and lines[2]["t0"] == pytest.approx(1.066)
    assert lines[1]["pr"] == [["p32", 0, 32, 32]] * 3 and lines[0]["pr"] == []
    imp = ImportTrace.from_env()
    imp.add({"rid": "r", "blocks": 4, "t": [1.0, 1.01, 1.05, 1.06, 1.07]})
    # A client stream with tokens 3 ms after each step end; the slow gap spans the admission.
    stream = [e + 0.003 for e in ends[1:]]
    rep = pd_trace.analyse(str(tmp_path), _Result((0.9, 1.2), [stream], [(1.0, 0.09, 64)]))
    eng = rep["engine"]
    assert eng["by_class"]["admit"]["steps"] == 1
    assert eng["by_class"]["import"]["calls_ms"] == pytest.approx(1.0, abs=0.01)
    assert eng["p99_ms"] == pytest.approx(45.0, abs=0.01)  # the admission step's interval
    assert rep["client"]["ge_p99_by_steps_within"] == {"admit": 1}
    assert rep["client"]["ge_p99_engine_ms_mean"] == pytest.approx(45.0, abs=0.01)
    assert rep["import_ms"]["write_pieces"]["p50"] == pytest.approx(10.0, abs=0.01)
    assert rep["import_ms"]["to_first_token"]["p50"] == pytest.approx(20.0, abs=0.01)


def _lines(path, recs) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def _step(t1, t2, *prompts, t3=None):
    """A step line; ``prompts``: (request id, first position, tokens, prompt length)."""
    pft = sum(p[2] for p in prompts)
    rec = {"t0": t1, "t1": t1, "t2": t2, "dec": 0, "pf": len(prompts), "pft": pft,
           "calls": [], "pr": [list(p) for p in prompts]}  # fmt: skip
    return rec if t3 is None else {**rec, "t3": t3}


def test_long_phases_pd_and_unified(tmp_path, pd_trace):
    # P/D: prompt B (1700 tokens) is sent at 1.1 while A's (1600) prefill runs 1.05-1.85:
    # it waits 0.75 s behind it, computes 1.86-2.66, is gathered by 2.67, imported 2.70-2.80.
    # C (1900) and D (1800) queue behind B and share a step (C's end and D's start, as a
    # 2048-token budget does); D's import was early: reserved at 2.7-2.72 beside its
    # prefill, its wait for the handle ended at 3.62.
    _lines(tmp_path / "prefill", [
        _step(1.05, 1.85, ("a", 0, 1600, 1600), t3=1.86),
        _step(1.86, 2.66, ("b", 0, 1700, 1700), t3=2.67),
        _step(2.67, 3.40, ("c", 0, 1800, 1900)),
        _step(3.40, 3.60, ("c", 1800, 100, 1900), ("d", 0, 1000, 1800), t3=3.61),
        _step(3.61, 3.71, ("d", 1000, 800, 1800), t3=3.72),
    ])  # fmt: skip
    _lines(tmp_path / "decode.imports", [
        {"rid": "x", "n": 1600, "blocks": 100, "t": [1.90, 1.92, 1.95, 1.97, 1.98],
         "handle": "a"},
        {"rid": "y", "n": 1700, "blocks": 107, "t": [2.70, 2.72, 2.75, 2.77, 2.80],
         "handle": "b"},
        {"rid": "z", "n": 1900, "blocks": 119, "t": [3.62, 3.64, 3.66, 3.68, 3.70],
         "handle": "c"},
        {"rid": "w", "n": 1800, "blocks": 113, "t": [2.70, 2.72, 3.74, 3.76, 3.78, 3.80],
         "handle": "d", "pending": True},
    ])  # fmt: skip
    res = _Result((0.0, 9.0), [], [(1.1, 1.75, 1700), (1.0, 1.02, 1600), (1.2, 2.55, 1900),
                                   (1.3, 2.55, 1800)])  # fmt: skip
    rep = pd_trace.long_phases(str(tmp_path), res, "pd")
    assert rep["prompts"] == 4 and rep["unmatched"] == 0 and rep["shared_step"] == 2
    assert rep["early"] == 1 and rep["reserve_early_ms"]["p50"] == pytest.approx(20.0, abs=0.01)
    ph = rep["phases_ms"]
    assert ph["queue_long"]["max"] == pytest.approx(2080.0, abs=0.01)  # D: 1.3 -> 3.40
    assert ph["compute"]["max"] == pytest.approx(930.0, abs=0.01)  # C: 2.67 -> 3.60
    assert ph["hand_over"]["max"] == pytest.approx(40.0, abs=0.01)  # A: 1.86 -> 1.90
    assert ph["to_first_token"]["max"] == pytest.approx(50.0, abs=0.01)  # B: 2.80 -> 2.85
    # D's path after its gather (3.72): no reserve left (0 of the four), its wait ended 3.74.
    assert ph["reserve"]["mean"] == pytest.approx(15.0, abs=0.01)  # (20 + 20 + 20 + 0) / 4
    assert ph["hand_over"]["p50"] == pytest.approx(30.0, abs=0.01)  # 40, 40, 20, 20 (D)
    total = sum(v["mean"] for v in ph.values())
    assert total == pytest.approx(rep["ttft_ms"]["mean"], abs=0.1)  # the phases add up
    # Unified: the same two prompts on two engines, beside decode steps: no long queue.
    _lines(tmp_path / "u0", [_step(1.0, 1.03), _step(1.03, 1.83, ("a", 0, 1600, 1600),
                                                     ("chat", 0, 32, 32))])  # fmt: skip
    _lines(tmp_path / "u1", [_step(1.1, 1.12), _step(1.12, 1.95, ("b", 0, 1700, 1700))])
    res = _Result((0.0, 9.0), [], [(1.0, 0.9, 1600), (1.1, 0.9, 1700)])
    rep = pd_trace.long_phases(str(tmp_path), res, "unified")
    assert rep["prompts"] == 2 and rep["per_engine"] == {"u0": 1, "u1": 1}
    ph = rep["phases_ms"]
    assert ph["queue_long"]["max"] == 0.0
    assert ph["queue_other"]["max"] == pytest.approx(30.0, abs=0.01)  # A behind a decode step
    assert ph["to_first_token"]["max"] == pytest.approx(70.0, abs=0.01)  # A: 1.9 - 1.83
