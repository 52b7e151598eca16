"""The lossy knobs' ranges and their conflicts (epqlab.engine.options; docs/DESIGN.md §3a, §3a'): a value that is no
threshold/margin/k/budget of the model is refused naming its range, skip-cold with ``n_seq_max > 1`` is refused by name
(it acts on single-token forward passes only), and knobs that decide on residency are refused beside prefetch. All
refusals come from the option checks, before the model loads."""
from __future__ import annotations

import pytest

import epqlab
from epqlab.engine.options import check_options
from epqlab.studies.ablation.grid import memory_points


@pytest.mark.parametrize("kw, msg", [
    (dict(skip_cold=True), r"skip_cold is the router-weight threshold tau in 0\.\.1 .*got True"),
    (dict(skip_cold=2.0), r"tau in 0\.\.1 .*got 2\.0"),
    (dict(skip_cold=-0.1), r"tau in 0\.\.1"),
    (dict(skip_cold="0.3"), r"tau in 0\.\.1"),
    (dict(route_bias="cache", route_delta=5.0), r"route_delta must be a router-probability margin in 0\.\.1.*5\.0"),
    (dict(adaptive_k=((0.5,), (1, 99))), r"ks must be in 1\.\.8 \(the model's experts per layer\), got \(1, 99\)"),
    (dict(expert_budget=0), r"expert_budget is the most distinct experts .* integer >= 1 .*got 0"),
    (dict(expert_budget=2.5), r"expert_budget .*got 2\.5"),
    (dict(expert_budget=True), r"expert_budget .*got True"),
    (dict(route_bias="union", route_delta=0.1), r"unknown route_bias 'union'; choose one of 'cache', 'batch'"),
    (dict(route_bias="batch"), r"route_bias='batch' needs route_delta"),
    (dict(expert_budget=4, skip_cold=0.3), r"expert_budget and skip_cold are exclusive"),
    (dict(expert_budget=4, prefetch="lookahead"), r"expert_budget and prefetch are exclusive"),
    (dict(route_bias="batch", route_delta=0.1, prefetch="lookahead"), r"route_bias and prefetch are exclusive"),
    (dict(expert_budget=4, pager=False), r"expert_budget rewrite the route in the pager's hook; drop pager=False"),
], ids=["skip_cold-True", "skip_cold-2", "skip_cold-neg", "skip_cold-str", "delta-5", "k-99", "budget-0",
        "budget-float", "budget-bool", "bias-unknown", "batch-no-delta", "budget-skip", "budget-prefetch",
        "batch-prefetch", "budget-nopager"])
def test_odd_values_refused_with_their_range(mini_gguf, kw, msg):
    lay = epqlab.inspect(mini_gguf)
    assert lay.n_expert == 8 and "qwen3moe.expert_weights_scale" not in lay.metadata  # weights are probabilities
    with pytest.raises(ValueError, match=msg):
        check_options(lay, **kw)


def test_edges_of_the_ranges_are_accepted(mini_gguf):
    lay = epqlab.inspect(mini_gguf)
    assert check_options(lay, skip_cold=1.0).skip_cold == 1.0
    assert check_options(lay, skip_cold=0).skip_cold == 0.0
    assert check_options(lay, route_bias="cache", route_delta=1.0).route_delta == 1.0
    assert check_options(lay, adaptive_k=((0.5,), (1, 8))).adaptive_k == ((0.5,), (1, 8))


def test_skip_cold_range_follows_the_models_weight_scale(default_path):
    """The default model (deepseek arch) scales its routing weights by k = 3 (expert_weights_scale), so a weight,
    and a meaningful tau, reaches 3."""
    lay = epqlab.inspect(default_path)
    assert lay.metadata[f"{lay.architecture}.expert_weights_scale"] == 3.0
    assert check_options(lay, skip_cold=2.0).skip_cold == 2.0
    with pytest.raises(ValueError, match=r"tau in 0\.\.3 "):
        check_options(lay, skip_cold=3.5)


def test_skip_cold_with_batched_decode_is_refused_by_name(mini_gguf):
    with pytest.raises(ValueError, match=r"^skip_cold acts on single-token forward passes only, so with n_seq_max=2 "
                                         r".*use n_seq_max=1 with skip_cold, or drop it"):
        epqlab.Session(mini_gguf, n_seq_max=2, skip_cold=0.3, pipeline_reads=False)


@pytest.mark.parametrize("kw", [dict(route_bias="cache", route_delta=0.05), dict(route_bias="batch", route_delta=0.05),
                                dict(adaptive_k=True), dict(expert_budget=3)], ids=["cache", "batch", "adaptive_k", "budget"])
def test_route_rewrites_are_accepted_with_batched_decode(mini_gguf, kw):
    """They act on every token of a batched decode step (tests/test_batch_lossy.py measures that they do)."""
    o = check_options(epqlab.inspect(mini_gguf), n_seq_max=4, **kw)
    assert (o.route_bias, o.expert_budget) == (kw.get("route_bias"), kw.get("expert_budget", 0))


def test_lossy_knob_in_generate_batch_of_one_sequence_at_a_time_acts(mini_gguf):
    """With n_seq_max=1 generate_batch decodes one sequence per step (single-token passes), so the knob acts there
    and its counters say so: route_delta=1 substitutes every non-resident choice a resident expert can replace."""
    half = memory_points(epqlab.inspect(mini_gguf), arenas=[0.5])[0].session_kwargs()
    with epqlab.Session(mini_gguf, **half, n_threads=1, io_threads=1, route_bias="cache", route_delta=1.0) as s:
        s.generate_batch(["Hello there", "The sea"], n_predict=6)
        st = s.stats
    assert st["lossy_slots"] > 0 and st["route_substituted"] > 0


def test_budget_above_n_expert_is_n_expert(mini_gguf):
    """A budget can never drop a slot past n_expert distinct experts: larger values (even past the engine's int) are
    taken as n_expert, not refused by the binding after the load."""
    lay = epqlab.inspect(mini_gguf)
    assert check_options(lay, expert_budget=2**40).expert_budget == lay.n_expert == 8
    with epqlab.Session(mini_gguf, n_seq_max=2, expert_budget=2**31) as s:
        assert s.expert_budget == 8
