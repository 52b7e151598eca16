"""The lossy knobs' ranges and their refusal in batched decode (epqlab.engine.options; docs/DESIGN.md §3a, §3a'):
a value that is no threshold/margin/k of the model is refused naming its range, and a lossy knob with
``n_seq_max > 1`` is refused by name, since the hook rewrites single-token forward passes only. All refusals
come from the option checks, before the model loads."""
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
], ids=["skip_cold-True", "skip_cold-2", "skip_cold-neg", "skip_cold-str", "delta-5", "k-99"])
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


@pytest.mark.parametrize("knob, kw", [("skip_cold", dict(skip_cold=0.3, pipeline_reads=False)),
                                      ("route_bias", dict(route_bias="cache", route_delta=0.05)),
                                      ("adaptive_k", dict(adaptive_k=True))])
def test_lossy_knob_with_batched_decode_is_refused_by_name(mini_gguf, knob, kw):
    with pytest.raises(ValueError, match=rf"^{knob} acts on single-token forward passes only, so with n_seq_max=2 "
                                         rf".*use n_seq_max=1 with {knob}, or drop {knob}"):
        epqlab.Session(mini_gguf, n_seq_max=2, **kw)


def test_lossy_knob_in_generate_batch_of_one_sequence_at_a_time_acts(mini_gguf):
    """With n_seq_max=1 generate_batch decodes one sequence per step (single-token passes), so the knob acts there
    and its counters say so: route_delta=1 substitutes every non-resident choice a resident expert can replace."""
    half = memory_points(epqlab.inspect(mini_gguf), arenas=[0.5])[0].session_kwargs()
    with epqlab.Session(mini_gguf, **half, n_threads=1, io_threads=1, route_bias="cache", route_delta=1.0) as s:
        s.generate_batch(["Hello there", "The sea"], n_predict=6)
        st = s.stats
    assert st["lossy_slots"] > 0 and st["route_substituted"] > 0
