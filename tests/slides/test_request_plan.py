"""The request planner's cost model: the stated rules, learnt from answers."""

from __future__ import annotations

from wsi_loader.slides.storage._request_plan import (
    COLD_DEADLINE_S,
    COLD_HEDGE_S,
    MAX_GAP,
    MIN_DEADLINE_S,
    MIN_GAP,
    MIN_HEDGE_S,
    WARM,
    CostModel,
    coalesce_groups,
)


def _learnt(latency: float, bandwidth: float, answers: int = 64) -> CostModel:
    model = CostModel()
    for i in range(answers):
        size = 20_000 + (i % 8) * 40_000  # sizes that differ, so the bandwidth can be told
        model.observe(size, latency + size / bandwidth)
    return model


def test_a_cold_model_is_cautious() -> None:
    model = CostModel()
    assert not model.warm
    assert model.hedge_after(25_000) == COLD_HEDGE_S
    assert model.deadline(25_000) == COLD_DEADLINE_S
    for _ in range(WARM - 1):
        model.observe(25_000, 0.02)
    assert not model.warm


def test_latency_and_bandwidth_are_learnt_and_set_the_merge_gap() -> None:
    model = _learnt(latency=0.02, bandwidth=20e6)
    assert abs(model.latency - 0.02) < 1e-3
    assert abs(model.bandwidth - 20e6) / 20e6 < 0.05
    assert abs(model.merge_gap() - 0.02 * 20e6) / (0.02 * 20e6) < 0.06  # 400 kB
    # a fast local network: the gap is the bandwidth-delay product, within its bounds
    assert _learnt(latency=0.0002, bandwidth=50e6).merge_gap() == MIN_GAP
    assert _learnt(latency=0.05, bandwidth=1e9).merge_gap() == MAX_GAP


def test_the_model_adapts_as_the_store_slows_down() -> None:
    model = _learnt(latency=0.005, bandwidth=100e6)
    fast_hedge, fast_gap = model.hedge_after(25_000), model.merge_gap()
    for i in range(256):
        size = 20_000 + (i % 8) * 40_000
        model.observe(size, 0.08 + size / 100e6)
    assert model.hedge_after(25_000) > 4 * fast_hedge
    assert model.merge_gap() > fast_gap  # requests got dearer: merge across wider gaps


def test_hedge_and_deadline_follow_the_slow_tail() -> None:
    model = _learnt(latency=0.02, bandwidth=100e6)
    steady = model.hedge_after(25_000)
    assert MIN_HEDGE_S <= steady < 0.2
    assert model.deadline(25_000) >= max(MIN_DEADLINE_S, 8 * steady) - 1e-9
    jittery = CostModel()
    for i in range(256):  # one answer in ten takes 5x as long
        jittery.observe(25_000, 0.02 * (5 if i % 10 == 0 else 1))
    assert jittery.hedge_after(25_000) > steady


def test_groups_respect_the_gap_and_the_largest_request() -> None:
    groups = coalesce_groups([(0, 10), (15, 10), (100, 10)], gap=5)
    assert groups == [((0, 25), [(0, 10), (15, 10)]), ((100, 10), [(100, 10)])]
    # a range alone may exceed the largest request; merging never makes one exceed it
    assert coalesce_groups([(0, 50), (50, 50), (100, 50)], gap=0, max_request=100) == [
        ((0, 100), [(0, 50), (50, 50)]),
        ((100, 50), [(100, 50)]),
    ]
    assert coalesce_groups([(0, 500)], gap=0, max_request=100) == [((0, 500), [(0, 500)])]
