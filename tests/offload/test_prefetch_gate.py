"""PrefetchGate: prefetching pauses while its accuracy over the last window is low, and probes again later."""

from __future__ import annotations

import pytest

from moerun.moe.offload import OffloadConfig
from moerun.moe.offload.prefetch import PrefetchGate
from moerun.moe.offload.stats import OffloadStats


def settle(stats: OffloadStats, useful: int, wasted: int) -> None:
    stats.prefetch_useful += useful
    stats.prefetch_wasted += wasted


def test_pauses_on_low_accuracy_then_probes_again() -> None:
    stats, gate = OffloadStats(), PrefetchGate(0.5, window=10, pause=3)
    settle(stats, 1, 5)
    assert gate.open(stats)  # 6 settled: the window is not full yet
    settle(stats, 1, 5)
    assert not gate.open(stats) and gate.pauses == 1  # 2 of 12 useful
    for _ in range(3):
        assert not gate.open(stats)  # the next 3 opportunities are skipped
    assert gate.open(stats)  # probing again
    settle(stats, 8, 2)
    assert gate.open(stats) and gate.pauses == 1  # 8 of 10 useful: stays open


def test_reset_statistics_keeps_a_pause_and_restarts_the_window() -> None:
    stats, gate = OffloadStats(), PrefetchGate(0.5, window=4, pause=2)
    settle(stats, 0, 4)
    assert not gate.open(stats)
    stats.reset()
    gate.reset()
    assert not gate.open(stats) and not gate.open(stats)  # still paused for the next 2 opportunities
    assert gate.open(stats)  # pause over; the window restarts from the reset counters
    settle(stats, 1, 2)
    assert gate.open(stats)
    settle(stats, 0, 1)
    assert not gate.open(stats) and gate.pauses == 2  # 1 of 4 useful since the reset


def test_disabled_gate_and_validation() -> None:
    stats, never = OffloadStats(), PrefetchGate(0.0, window=1, pause=100)
    settle(stats, 0, 50)
    assert never.open(stats) and never.pauses == 0
    with pytest.raises(ValueError, match="prefetch_min_accuracy"):
        OffloadConfig(prefetch_min_accuracy=1.5)
