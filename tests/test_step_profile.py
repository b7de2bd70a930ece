"""dflash-profile-step: a step's time by phase, host and passes apart, and the operations a step dispatches."""
from __future__ import annotations

import json

import pytest

from dflash_runtime.step_clock import PASSES
from dflash_tools import step_profile


def test_the_step_profile_accounts_for_each_steps_time_by_phase(tmp_path, capsys):
    """On the tiny random target: every row's phases add up to its step (medians of the same steps, so within a
    few percent), a drafting step runs the draft and context passes and dispatches more operations than a plain
    one, and the table prints every row."""
    out = tmp_path / "profile.json"
    assert step_profile.main(["--targets", "tiny", "--batch-sizes", "1", "4", "--steps", "12", "--threads", "1",
                              "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["target"], r["batch"], r["block"]) for r in rows] == [("tiny", 1, 1), ("tiny", 1, 8), ("tiny", 4, 1),
                                                                    ("tiny", 4, 8)]
    for r in rows:
        phases = r["phases_us"]
        assert 0.7 * r["step_ms"] * 1e3 < sum(phases.values()) < 1.3 * r["step_ms"] * 1e3, r
        assert 0 < r["host_us"] < r["step_ms"] * 1e3 and r["passes_ms"] > 0
        assert {"schedule", "inputs", "accept", "commit", "verify pass"} <= set(phases)
        drafting = {"draft pass", "context pass", "propose"} <= set(phases)
        assert drafting == (r["block"] > 1), phases
        assert r["ops_per_layer"] == pytest.approx(r["ops_per_step"] / 4, abs=0.1)
    assert rows[1]["ops_per_step"] > rows[0]["ops_per_step"] > 50
    assert set(PASSES) >= {p for r in rows for p in r["phases_us"] if p.endswith("pass")}
    printed = capsys.readouterr().out
    assert printed.count("| tiny |") == 4 and "ops/layer" in printed


def test_the_step_profile_refuses_sizes_that_cannot_run(capsys):
    for bad in (["--batch-sizes", "0"], ["--blocks", "1"], ["--steps", "0"], ["--prefill-stall", "-5"],
                ["--prefill-stall", "64", "--prefill-chunk", "0"]):
        try:
            step_profile.main(["--targets", "tiny", *bad])
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(bad)
    assert "must be >= 1" in capsys.readouterr().err


def test_the_prefill_stall_times_a_stream_beside_a_prompt_prefilled_in_chunks(tmp_path, capsys):
    """A 200-token prompt beside a decoding stream prefills in chunks of 32 (7 steps or more, the stream stepping in
    each, their wall time the prefill's); the stream's time per token and longest wait are ratios to its steps
    alone, and the table prints them."""
    out = tmp_path / "stall.json"
    assert step_profile.main(["--targets", "tiny", "--prefill-stall", "200", "--prefill-chunk", "32", "--steps", "6",
                              "--threads", "1", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["target"], row["prompt_tokens"], row["chunk"]) == ("tiny", 200, 32)
    assert row["prefill_steps"] >= 7  # chunks of 32 at most: fewer where the pace says (prefill_pacing.py)
    assert row["alone_ms_per_token"] > 0 and row["prefill_seconds"] > 0
    ratios = [f"{phase}_{ratio}_x" for phase in ("during", "joined") for ratio in ("per_token", "longest_wait")]
    assert all(row[key] > 0 for key in ratios)
    assert "| tiny | 200 | 32 |" in capsys.readouterr().out
