"""The forecast arithmetic of ``epqlab plan`` (epqlab/studies/plan_model.py) against hand computations on a synthetic
trace and probe, and the plan's miss simulation against the live pager's replay of the same trace.

The hand numbers (µs) in the comments are worked out from the module docstring's formulas, not by running them."""
from __future__ import annotations

import numpy as np
import pytest

import epqlab
from epqlab.routes.log import RouteLog
from epqlab.studies.plan import simulate_misses, slots_at, split_text, parse_budgets, PlanInputError
from epqlab.studies.plan_model import (DeviceTable, LayerShape, Terms, decode_us_off, decode_us_prefetch,
                                       expected_union, prefill_us, read_us)

from ggufs import LayerSpec, write_moe

# one probed size, 1000-byte reads: 10 MB/s with 1 in flight, 16 with 2, 20 with 4
DEV = DeviceTable({1000: ((1, 2, 4), (10.0, 16.0, 20.0))})
SHAPES = [LayerShape(3000, 3), LayerShape(3000, 3)]  # an expert = 3 matrices of 1000 bytes
MISSES = np.array([[1, 0], [2, 1]])                   # 2 decode steps x 2 layers


def test_read_time_by_hand():
    # 1 expert: 3 reads of 1000 B, 3 in flight -> 18 MB/s (between 16 at 2 and 20 at 4): 3000 / 18e6 s
    assert read_us(1, 3000, 3, 4, DEV) == pytest.approx(3000 / 18e6 * 1e6)
    # 2 experts: 6 reads, 4 in flight (the threads) -> 20 MB/s: 300 µs
    assert read_us(2, 3000, 3, 4, DEV) == pytest.approx(300.0)
    assert read_us(0, 3000, 3, 4, DEV) == 0.0
    # past the probed concurrencies the end value holds; sizes snap to the nearest probed size
    assert DEV.bandwidth(1000, 9) == 20.0 and DEV.bandwidth(900, 1) == 10.0


def test_decode_off_by_hand():
    t = Terms(compute_us=1000.0, map_us_per_miss=10.0, k_io=1.5, io_threads=4)
    parts = decode_us_off(MISSES, SHAPES, t, DEV)
    # step 0: read(1) = 166.667; step 1: read(2) + read(1) = 300 + 166.667 -> mean 316.667, x k_io 1.5 = 475
    # map: 10 µs x (1 + 3) misses / 2 steps = 20
    assert parts["io"] == pytest.approx(475.0)
    assert parts["map"] == pytest.approx(20.0)
    assert parts["total"] == pytest.approx(1495.0)


def test_reads_take_compute_by_hand():
    t = Terms(compute_us=1000.0, map_us_per_miss=0.0, k_io=0.0, io_threads=4, kappa_us_per_mb=1000.0)
    # MB per step: 1 x 3000 B, then 3 x 3000 B -> mean 0.006 MB -> 6 µs more compute
    assert decode_us_off(MISSES, SHAPES, t, DEV)["compute"] == pytest.approx(1006.0)
    tp = Terms(**{**t.__dict__, "waste_per_layer": 0.5})
    # + 0.5 wasted unit per layer and step: 2 layers x 0.5 x 3000 B = 0.003 MB more
    assert decode_us_prefetch(MISSES, SHAPES, tp, DEV)["compute"] == pytest.approx(1009.0)


def test_layers_that_wait_take_compute_by_hand():
    """C = C0 + c_wait x W(t), W(t) = sum_l min(1, m[t,l]): MISSES [[1, 0], [2, 1]] -> W = 1, then 2 -> mean 1.5; at
    200 µs per waiting layer, 300 µs more. Half the misses (a policy's scaled count) -> W = 0.5, 1 + 0.5 -> mean 1.0."""
    from epqlab.studies.plan_model import step_waits

    t = Terms(compute_us=1000.0, map_us_per_miss=0.0, k_io=0.0, io_threads=4, wait_us_per_layer=200.0)
    assert list(step_waits(MISSES)) == [1.0, 2.0]
    assert decode_us_off(MISSES, SHAPES, t, DEV)["compute"] == pytest.approx(1300.0)
    assert decode_us_off(MISSES * 0.5, SHAPES, t, DEV)["compute"] == pytest.approx(1200.0)
    assert decode_us_prefetch(MISSES, SHAPES, t, DEV)["compute"] == pytest.approx(1300.0)


def test_predictor_cost_scales_with_the_misses_it_covers():
    """P = 50 µs measured at 3 would-be misses per step: MISSES has 1 and 3 -> mean 2 -> 50 x 2/3; at all-resident
    (no misses) 0; more misses than the calibration's cap it at P; predict_misses_per_step 0 keeps P fixed."""
    t = Terms(compute_us=1000.0, map_us_per_miss=0.0, k_io=0.0, io_threads=4, predict_us=50.0, phi=0.5,
              predict_misses_per_step=3.0)
    assert decode_us_prefetch(MISSES, SHAPES, t, DEV)["predict"] == pytest.approx(50 * 2 / 3)
    assert decode_us_prefetch(MISSES * 0, SHAPES, t, DEV)["predict"] == 0.0
    assert decode_us_prefetch(MISSES * 4, SHAPES, t, DEV)["predict"] == pytest.approx(50.0)
    t.predict_misses_per_step = 0.0
    assert decode_us_prefetch(MISSES * 0, SHAPES, t, DEV)["predict"] == 50.0


def test_decode_prefetch_by_hand():
    t = Terms(compute_us=1000.0, map_us_per_miss=10.0, k_io=1.5, io_threads=4, predict_us=50.0, phi=0.5,
              waste_per_layer=0.0, window_us=100.0, k_pf=2.0)
    parts = decode_us_prefetch(MISSES, SHAPES, t, DEV)
    r_half = 1500 / 13e6 * 1e6          # 0.5 expert: 1.5 reads, 1.5 in flight -> 13 MB/s: 115.385 µs
    r_one = 3000 / 18e6 * 1e6           # 166.667
    step0 = r_half + max(0, r_half - 100)                               # layer 0 (m = 1); layer 1 has none
    step1 = (r_one + max(0, r_one - 100)) + (r_half + max(0, r_half - 100))
    assert parts["io"] == pytest.approx(2.0 * (step0 + step1) / 2)      # 494.872
    assert parts["total"] == pytest.approx(1000 + 50 + 2.0 * (step0 + step1) / 2 + 20)


def test_prefetch_wasted_reads_cost_device_time():
    base = Terms(compute_us=0.0, map_us_per_miss=0.0, k_io=1.0, io_threads=4, phi=1.0, window_us=0.0, k_pf=1.0)
    waste = Terms(**{**base.__dict__, "waste_per_layer": 1.0})
    # phi = 1, W = 0: everything is read early and waited for; one wasted expert per layer adds its read
    a = decode_us_prefetch(MISSES, SHAPES, base, DEV)["io"]
    b = decode_us_prefetch(MISSES, SHAPES, waste, DEV)["io"]
    # step 0: read(1) vs read(2) on layer 0 and 0 vs read(1) on layer 1; step 1: read(2)+read(1) vs read(3)+read(2)
    r = lambda n: read_us(n, 3000, 3, 4, DEV)  # noqa: E731
    assert a == pytest.approx((r(1) + r(2) + r(1)) / 2)
    assert b == pytest.approx((r(2) + r(1) + r(3) + r(2)) / 2)


def test_union_and_prefill_by_hand():
    # q = [0.5, 0, 0.25]: U(2) = (1 - 0.25) + 0 + (1 - 0.5625) = 1.1875
    assert expected_union(np.array([[2, 0, 1]]), 4, 2)[0] == pytest.approx(1.1875)
    t = Terms(compute_us=0.0, map_us_per_miss=0.0, k_io=1.0, prefill_us_per_token=100.0)
    pre = prefill_us(10, np.array([2.0, 1.0]), SHAPES, t, DEV)
    # 10 tokens x 100 µs + (2 + 1) experts x 3000 B at the best 20 MB/s = 1000 + 450
    assert pre["compute"] == 1000.0 and pre["io"] == pytest.approx(450.0) and pre["total"] == pytest.approx(1450.0)


def test_inputs_refused_by_name():
    with pytest.raises(PlanInputError, match="budgets"):
        parse_budgets("lots")
    with pytest.raises(PlanInputError, match="no positive"):
        parse_budgets(",")
    assert parse_budgets("8GiB, 4GiB") == [4 * 2**30, 8 * 2**30]
    a, b = split_text("one two.\n\nthree four.\n\nfive six.\n\nseven eight.")
    assert a + b == "one two.\n\nthree four.\n\nfive six.\n\nseven eight." and a and b


@pytest.fixture(scope="module")
def one_class(tmp_path_factory):
    """4 MoE layers x 8 experts, top-2, one slot class (F32 128x16 matrices at 4096 alignment)."""
    path = tmp_path_factory.mktemp("plan") / "one.gguf"
    write_moe(path, [LayerSpec(i, "F32", 128, 16) for i in range(4)], n_expert=8, n_expert_used=2, alignment=4096)
    return epqlab.inspect(path)


def _log(lay, T=40, seed=0):
    rng = np.random.default_rng(seed)
    p = np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.07, 0.05, 0.03])
    ex = np.stack([[rng.choice(8, 2, replace=False, p=p) for _ in range(4)] for _ in range(T)]).astype(np.int32)
    return RouteLog(experts=ex, layers=np.array(lay.moe_layers, np.int32), phase=np.ones(T, np.uint8),
                    expert_bytes=np.array([l.expert_bytes for l in lay.layers], np.int64), n_expert=8)


@pytest.mark.parametrize("slots", [4, 9, 17])
def test_simulated_misses_equal_the_pagers_replay(one_class, slots):
    """The plan's LRU misses per (token, layer) sum to the live pager's misses replaying the same trace, and its
    per-policy counts equal the replay's hits for every simulated policy."""
    unit = epqlab.Pager.unit_slot_bytes(one_class)[0]
    cs = slots_at(one_class, slots * unit)
    assert cs == {unit: slots}
    log = _log(one_class)
    miss, agg = simulate_misses(log, [unit] * 4, cs, ("lru", "ls", "ls_pos", "belady"))
    for pol in ("lru", "ls", "ls_pos", "belady"):
        st = epqlab.Pager(one_class, slots * unit, policy=pol).replay(log)
        assert agg[pol] == (st["hits"], st["requests"]), pol
    assert int(miss.sum()) == agg["lru"][1] - agg["lru"][0]


def test_fit_compute_recovers_the_line_and_ignores_outliers():
    """C0 and kappa from a calibration's steps: a cold arena's steps read 40 -> 2 MB; compute = 9000 µs + 120 µs/MB,
    with two steps slowed 5x (a page fault storm, a busy core): the Theil-Sen line is the true one, where a least
    squares fit is pulled far off. Steps whose MB barely vary give kappa 0 and the median."""
    from epqlab.studies.plan_model import fit_compute

    mb = np.linspace(40, 2, 32)
    y = 9000 + 120 * mb
    y[[3, 20]] *= 5
    c0, kappa, how = fit_compute(y, mb)
    assert how == "fit" and kappa == pytest.approx(120, rel=1e-6) and c0 == pytest.approx(9000, rel=1e-6)
    ls_slope = np.polyfit(mb, y, 1)[0]
    assert abs(ls_slope - 120) > 30  # what an ordinary fit would have said
    flat = np.full(32, 10.0) + np.linspace(0, 0.5, 32)
    c0, kappa, how = fit_compute(9000 + 120 * flat, flat)
    assert how == "median" and kappa == 0 and c0 == pytest.approx(np.median(9000 + 120 * flat))
    with pytest.raises(ValueError, match="step"):
        fit_compute([1.0, 2.0], [1.0])


def test_resident_compute_takes_only_steps_that_read_nothing():
    """The resident run's first steps still read (the arena fills), its later ones read nothing: C0 is the median
    compute of the steps whose io wait + mapping is at most 2% of their wall time, the line then runs from (0 MB, C0)
    to the paged calibration's (mean x, median compute). Worked by hand: C0 = median(9000, 9100, 9050, 8950, 9020)
    = 9020 µs; the calibration's median compute 14020 µs at a mean 5 MB per step: kappa = 5000 / 5 = 1000 µs/MB."""
    from epqlab.studies.plan_model import compute_line, resident_compute

    compute = [15000, 12000, 9000, 9100, 9050, 8950, 9020]
    io_map = [9000, 3000, 0, 100, 0, 179, 0]          # 179 µs of 9129: just under 2%
    wall = [c + w for c, w in zip(compute, io_map)]
    c0, n = resident_compute(wall, compute)
    assert n == 5 and c0 == pytest.approx(9020)
    io_map[5] = 200                                    # 200 of 9150: over 2%, the step drops out
    c0, n = resident_compute([c + w for c, w in zip(compute, io_map)], compute)
    assert n == 4 and c0 == pytest.approx(np.median([9000, 9100, 9050, 9020]))
    assert resident_compute([10.0, 20.0, 30.0], [1.0, 2.0, 3.0]) == (None, 0)
    c0, kappa = compute_line(9020, [14020, 13000, 15000], [4.0, 5.0, 6.0])
    assert c0 == 9020 and kappa == pytest.approx(1000)
    assert compute_line(9020, [8000, 8100], [4.0, 6.0])[1] == 0.0  # a slower resident run: no negative slope
    assert compute_line(9020, [14020], [0.0]) == (9020.0, 0.0)     # a calibration whose steps wait nowhere: no line
    with pytest.raises(ValueError, match="step"):
        resident_compute([1.0, 2.0], [1.0])


def test_resident_run_needs_top_k_slots_for_every_layer(default_path):
    """The resident run is made only where the smallest budget's arena holds top-k experts of every layer of each
    slot class at once (counted by hand from the layout); one slot fewer in any class and plan says why not."""
    from epqlab.layout import inspect
    from epqlab.studies.plan import _classes, resident_run_possible

    lay = inspect(default_path)
    slot_b, _ = _classes(lay)
    k = lay.n_expert_used
    enough = {b: k * slot_b.count(b) for b in set(slot_b)}
    assert resident_run_possible(lay, enough) is None
    for b in enough:
        short = {**enough, b: enough[b] - 1}
        why = resident_run_possible(lay, short)
        assert why and f"{enough[b] - 1} slots" in why and f"({enough[b]})" in why
