"""`pagefleet generate` runs the engine alone on the tiny model and prints its report."""

from __future__ import annotations

from click.testing import CliRunner

from pagefleet.cli import cli
from pagefleet.dev.generate import synthetic_prompts


def test_generate_prints_a_report() -> None:
    res = CliRunner().invoke(
        cli,
        [
            "generate",
            "--num-prompts",
            "6",
            "--max-tokens",
            "4",
            "--block-size",
            "8",
            "--ignore-eos",
        ],
    )
    assert res.exit_code == 0, res.output
    out = res.output
    for label in (
        "requests",
        "generated tokens",
        "TTFT p50 / p90",
        "TPOT p50 / p90",
        "prefix-cache hit rate",
    ):
        assert label in out
    assert "│ 6 " in out or "| 6 " in out  # six requests finished
    assert "│ 24 " in out or "| 24 " in out  # 6 x 4 generated tokens


def test_synthetic_prompts_share_system_prompts() -> None:
    ps = synthetic_prompts(9, seed=1)
    assert len(ps) == 9 and len(set(ps)) == 9
    assert len({p.split("\n")[0] for p in ps}) == 3
