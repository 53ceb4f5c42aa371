"""The tuners' final rounds: interleaved timing and the pick that keeps the shipped config against noise."""

from __future__ import annotations

from moerun.bench.timing import interleaved_rounds, pick_final


def test_rounds_interleave_the_candidates() -> None:
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    times = interleaved_rounds(fns, rounds=2, warmup_ms=0, rep_ms=0)
    assert {name: len(t) for name, t in times.items()} == {"a": 2, "b": 2, "c": 2}
    # each measurement runs its fn back to back (twice on the CPU); the next candidate follows, round after round
    runs = [name for i, name in enumerate(calls) if i == 0 or calls[i - 1] != name]
    assert runs == ["a", "b", "c", "a", "b", "c"]


def test_pick_keeps_the_incumbent_within_the_margin() -> None:
    times = {"#1": [9.9, 10.0, 10.1], "#2": [10.4, 10.5, 10.6], "shipped": [10.1, 10.2, 10.3]}
    assert pick_final(times, "shipped", min_gain=0.02) == "shipped"  # 10.0 is not 2% under 10.2
    assert pick_final(times, "shipped", min_gain=0.01) == "#1"
    assert pick_final(times, None, min_gain=0.02) == "#1"
    assert pick_final({**times, "#1": [9.0, 9.5, 12.0]}, "shipped", min_gain=0.02) == "#1"  # the median counts
