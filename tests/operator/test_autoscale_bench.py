"""bench/autoscale.py's bound for any policy, and its plot default (the committed plots in
docs/ change only when asked)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_autoscale", ROOT / "bench/autoscale.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_autoscale"] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


def test_request_work_is_prefill_plus_the_fullest_batchs_share_per_decoded_token(bench):
    cost = bench.EngineCost(prefill_tok_s=1000.0, step_base_s=0.032, step_per_seq_s=0.002)
    req = bench.Request(arrival=0.0, prompt=500, output=11)
    # 500 / 1000 s of prefill; 10 decode steps at 32 ms / 32 seqs + 2 ms each.
    assert bench.request_work(cost, req, 32) == pytest.approx(0.5 + 10 * 0.003)
    assert bench.request_work(cost, bench.Request(0.0, 0, 1), 32) == 0.0


def test_the_bound_drops_the_costliest_requests_the_target_allows(bench):
    cost = bench.EngineCost(prefill_tok_s=100.0, step_base_s=0.0, step_per_seq_s=0.0)
    trace = [bench.Request(float(i), prompt=100 * (i + 1), output=1) for i in range(20)]
    # works 1, 2, ..., 20 s; 95% of 20 requests: one may miss, at best the 20 s one.
    b = bench.work_lower_bound(trace, cost, 32, 0.95)
    assert b.total_work == pytest.approx(210 / 3600)
    assert b.droppable == pytest.approx(20 / 3600)
    assert b.hours == pytest.approx(190 / 3600)
    assert bench.work_lower_bound(trace, cost, 32, 0.90).hours == pytest.approx(171 / 3600)


@pytest.mark.parametrize("trace_name", ["synthetic", "azure-conv"])
def test_no_simulated_fleet_that_meets_the_target_costs_less_than_the_bound(bench, trace_name):
    """The bound holds for the fleet model itself: static fleets of every size on a short
    day, each that reaches 95% attainment costs at least the bound, and the smallest
    fleet that reaches it is at most a few times the bound (the bound is not vacuous)."""
    cost = bench.EngineCost(966.8, 0.02408, 0.002275)
    trace, rate, _ = bench.TRACES[trace_name](300.0, 3.0, seed=3)
    cfg = bench.SimConfig(ttft_s=6.0, tpot_s=0.3, dt=0.05)
    bound = bench.work_lower_bound(trace, cost, cfg.max_num_seqs, 0.95)
    reached = []
    for n in range(1, 9):
        res = bench.simulate(trace, rate, 300.0, cost, cfg, n, bench.static_policy)
        if res.attainment >= 0.95:
            assert res.replica_hours >= bound.hours
            reached.append(res.replica_hours)
    assert reached, "no static fleet up to 8 replicas met the SLO: the check saw nothing"
    assert min(reached) <= 4 * bound.hours


def test_the_plot_is_written_only_where_asked(bench):
    assert bench.parser().parse_args([]).plot is None
    assert bench.parser().parse_args(["--plot", "docs/autoscale.png"]).plot == Path(
        "docs/autoscale.png"
    )


def test_the_ledger_closes_and_books_the_stated_headroom(bench):
    """The planner's replica-hours above the oracle split into items that add up (the
    ledger's closing term stays ~0), and a larger headroom shows in its own item, as does
    the queue model's spare when it sizes the fleet."""
    cost = bench.EngineCost(966.8, 0.02408, 0.002275)
    trace, rate, _ = bench.TRACES["synthetic"](300.0, 3.0, seed=3)
    cfg = bench.SimConfig(ttft_s=6.0, tpot_s=0.3, dt=0.05)
    booked = {}
    for sizing, headroom in (("utilization", 0.0), ("utilization", 0.5), ("queue", 0.0)):
        planner = bench.PlannerConfig(
            role="unified", min_replicas=1, max_replicas=8, ttft_s=cfg.ttft_s,
            tpot_s=cfg.tpot_s, max_num_seqs=cfg.max_num_seqs, scale_up_window_s=0.0,
            scale_down_window_s=cfg.down_window_s, max_step_up=4,
            observation_window_s=cfg.rate_window_s, startup_s=cfg.startup_s,
            prefill_capacity_hint=cost.prefill_tok_s, decode_capacity_hint=300.0,
            headroom=headroom, sizing=sizing,
        )  # fmt: skip
        ledger = bench.Ledger(lambda _: 1)  # an oracle of one replica: all else is booked
        res = bench.simulate(
            trace, rate, 300.0, cost, cfg, 2, bench.planner_policy(planner, ledger), ledger
        )
        summary = ledger.summary()
        assert abs(summary["unexplained"]) < 1e-3
        assert summary["total"] == pytest.approx(res.replica_hours, abs=1e-3)
        assert all(summary[k] >= 0 for k in bench.Ledger.ITEMS)
        booked[sizing, headroom] = summary["headroom"]
    assert booked["utilization", 0.0] == 0.0
    assert booked["utilization", 0.5] > 0.01
    assert booked["queue", 0.0] > 0.0


def test_compare_prints_every_variant_per_day_and_marks_held_out_days(bench, capsys):
    """--compare runs each named variant and the HPA-like policy on every day asked for,
    marks the days no setting was tuned on, and ends with one JSON object; a variant that
    changes nothing equals the planner's own row (the comparison is deterministic)."""
    assert not bench.held_out("synthetic", 4) and bench.held_out("synthetic", 5)
    assert bench.held_out("two-peak", 0) and not bench.held_out("azure-conv", 0)
    args = bench.parser().parse_args(
        ["--compare", "--compare-traces", "two-peak", "--compare-seeds", "1",
         "--peak-replicas", "2", "--variant", "same={}",
         "--variant", 'k1={"queue_variability": 1.0}']
    )  # fmt: skip
    cost = bench.EngineCost(966.8, 0.02408, 0.002275)
    bench.compare(args, cost, 240.0)
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    runs = out["compare_runs"]
    assert set(runs) == {"planner", "wait-while-starting", "same", "k1", "hpa"}
    assert runs["same"] == runs["planner"]
    assert all(0 < a <= 1 and f > 0 for r in runs.values() for a, f in r.values())
    assert any("two-peak/1 (held out)" in line for line in lines)
    assert set(out["compare_summary"]["planner"]) == {"two-peak held out"}
