"""The oracle prefetch (the ceiling of every predictor): replaying an earlier identical run's routes,
every prediction is right, logits stay bit-identical to plain llama.cpp, and bad logs are refused."""
from __future__ import annotations

import numpy as np
import pytest

import epqlab
from epqlab.engine.prefetch import oracle_routes
from epqlab.routes import RouteLog
from epqlab.routes.log import RouteLogError
from exact import N_STEPS, THREADS, check_identical, small_arena


@pytest.fixture(scope="module")
def recorded(default_path, ref, tmp_path_factory):
    """The route log of plain llama.cpp running the same greedy trace as ``ref``."""
    path = tmp_path_factory.mktemp("oracle") / "routes.npz"
    toks = ref[0]
    with epqlab.Session(default_path, pager=False, n_threads=THREADS, route_log=path) as s:
        s.greedy_trace(toks, N_STEPS)
    return RouteLog.load(path), path


@pytest.mark.parametrize("pipeline,depth", [(False, 1), (True, 2), (True, 8)])
def test_oracle_predicts_every_expert_and_keeps_logits(default_path, ref, recorded, pipeline, depth, tmp_path):
    log, path = recorded
    # single-token forward passes counted from the log's ubatch ids alone
    ub, n = np.unique(log.ubatch, return_counts=True)
    n_single = int((n == 1).sum())
    assert n_single >= N_STEPS - 1
    st = check_identical(default_path, ref, "lru", "oracle", 0, pipeline, depth=depth, predictor=str(path),
                          route_log=tmp_path / "replay.npz")
    # every single-token pass predicts layers 1..L-1 one layer ahead (layer 0 has no layer before it),
    # k experts each, and all of them are right
    want = n_single * (log.n_layers - 1) * log.k
    assert st["pred_experts"] == want and st["pred_correct"] == want and st["pred_actual"] == want
    # every unit read ahead, the wrapped ones (the next step's first layers) included, was used: a wrong
    # row would be read in vain
    assert st["prefetch_used"] == st["prefetch_units"] - st["prefetch_cancelled"] - st["prefetch_failed"] > 0


def test_oracle_table_is_the_logs_decode_steps(recorded):
    log, path = recorded
    table, follows = oracle_routes(path, log.n_layers, log.n_expert)
    decode = log.experts[log.phase == 1]  # a greedy trace decodes one token per forward pass
    assert table.dtype == np.int32 and np.array_equal(table[-len(decode):], decode)
    # each decode step's next pass is the next step, but the last one's (there is none)
    assert follows.tolist()[-len(decode):] == [1] * (len(decode) - 1) + [0]


def test_oracle_replays_calls_across_reset_and_generations(default_path, tmp_path):
    """One pass, reset_stats, then two generations: every prediction right (passes keep their own ids across
    reset_stats), and no read ahead for a generation's last step crosses into the next run's stats (the
    next pass is a prompt, not the next row)."""
    def calls(s):
        s.generate([1], n_predict=1)  # one single-token pass, then the counters restart
        s.reset_stats()
        return [s.generate("A CPU cache is", n_predict=5), s.generate("Memory is", n_predict=5)]

    with epqlab.Session(default_path, pager=False, n_threads=THREADS, route_log=tmp_path / "rec.npz") as s:
        want = [g.tokens for g in calls(s)]
    with epqlab.Session(default_path, arena_bytes=small_arena(default_path), prefetch="oracle", prefetch_depth=2,
                        prefetch_predictor=tmp_path / "rec.npz", n_threads=THREADS, io_threads=2,
                        route_log=tmp_path / "replay.npz") as s:
        gens = calls(s)
        stats = s.stats
    assert [g.tokens for g in gens] == want
    assert stats["pred_experts"] > 0 and stats["pred_correct"] == stats["pred_experts"]
    for g in gens:
        assert 0 < g.stats["prefetch_used"] <= g.stats["prefetch_units"]


def test_oracle_errors(default_path, recorded, mini_gguf, tmp_path):
    log, path = recorded
    with pytest.raises(ValueError, match="needs prefetch_predictor"):
        epqlab.Session(default_path, prefetch="oracle")
    with pytest.raises(ValueError, match="record this one too"):
        epqlab.Session(default_path, prefetch="oracle", prefetch_predictor=path)
    with pytest.raises(ValueError, match="record the oracle's log on this model"):
        epqlab.Session(mini_gguf, prefetch="oracle", prefetch_predictor=path)
    old = RouteLog(log.experts, log.layers, log.phase, log.expert_bytes, log.n_expert, log.meta, ubatch=None)
    with pytest.raises(RouteLogError, match="no ubatch ids"):
        epqlab.Session(default_path, prefetch="oracle", prefetch_predictor=old)
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a route log")
    with pytest.raises(RouteLogError):
        epqlab.Session(default_path, prefetch="oracle", prefetch_predictor=bad)
    # natively: an id outside the model's experts (a hand-made table)
    with epqlab.Session(default_path, prefetch="oracle", prefetch_predictor=log, route_log=tmp_path / "r.npz") as s:
        table, follows = oracle_routes(log, log.n_layers, log.n_expert)
        table[0, 0, 0] = log.n_expert
        with pytest.raises(ValueError, match="outside"):
            s.decoder.engine.set_oracle(table, follows)
    with pytest.raises(ValueError, match="would overwrite the route log it replays"):
        epqlab.Session(default_path, prefetch="oracle", prefetch_predictor=path, route_log=path)
    with pytest.raises(RouteLogError, match="is a directory"):
        epqlab.Session(default_path, prefetch="oracle", prefetch_predictor=tmp_path, route_log=tmp_path / "r.npz")
    with pytest.raises(TypeError, match="prefetch_predictor must be a route log"):
        epqlab.Session(default_path, prefetch="oracle", prefetch_predictor=3, route_log=tmp_path / "r.npz")


def test_oracle_batches_carried_past_a_decode(default_path, ref, tmp_path):
    """A log longer than the trace: the last step's wrapped batch (the next token's first layers) is
    still in flight when the trace ends; a prefill from an empty context settles it and gives plain
    llama.cpp's logits, and closing with one in flight waits for it."""
    toks, (rp, rs, rg) = ref
    path = tmp_path / "long.npz"
    with epqlab.Session(default_path, pager=False, n_threads=THREADS, route_log=path) as s:
        s.greedy_trace(toks, N_STEPS + 3)
    with epqlab.Session(default_path, arena_bytes=small_arena(default_path), prefetch="oracle", prefetch_predictor=path,
                        prefetch_depth=2, n_threads=THREADS, io_threads=2, route_log=tmp_path / "replay.npz") as s:
        p, st, gen = s.greedy_trace(toks, N_STEPS)
        assert np.array_equal(p, rp) and np.array_equal(st, rs) and gen == rg
        assert s._pager.native.prefetch_active  # the wrapped batch of the step after the last
        assert np.array_equal(s.logits(toks), rp)
        stats = s.stats
    assert stats["prefetch_units"] > 0 and stats["pred_correct"] == stats["pred_experts"] > 0
    with epqlab.Session(default_path, arena_bytes=small_arena(default_path), prefetch="oracle", prefetch_predictor=path,
                        n_threads=THREADS, io_threads=2, route_log=tmp_path / "replay2.npz") as s:
        s.greedy_trace(toks, N_STEPS)
        assert s._pager.native.prefetch_active  # closed with the batch in flight
