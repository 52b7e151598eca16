"""epqlab.routes: route logs, analyses and cache simulators. Every expected number below is worked out by hand
in the comments (or, for the property tests, follows from the definitions), never read back from the code."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epqlab.routes import (RouteLog, RouteLogError, one_off_share, popularity, reuse_histogram, simulate,
                           simulate_reference, union_sizes)
from epqlab.routes.analysis import reuse_distances

# 6 tokens x 2 layers x k=2, n_expert=4
HAND = [
    [[0, 1], [0, 1]],
    [[0, 2], [0, 1]],
    [[1, 2], [0, 1]],
    [[0, 1], [2, 3]],
    [[3, 0], [2, 3]],
    [[3, 1], [0, 1]],
]


@pytest.fixture
def hand():
    return RouteLog.from_arrays(HAND, n_expert=4, expert_bytes=[100, 10])


# ------------------------------------------------------------------------------------------ format
def test_save_load_roundtrip(tmp_path, hand):
    p = tmp_path / "r.npz"
    hand.save(p)
    z = np.load(p)
    assert z["experts"].dtype == np.int32 and z["experts"].shape == (6, 2, 2)
    assert z["phase"].dtype == np.uint8 and z["expert_bytes"].dtype == np.int64 and z["layers"].dtype == np.int32
    assert "ubatch" not in z.files  # optional: a log without passes writes none
    back = RouteLog.load(p)
    assert np.array_equal(back.experts, np.array(HAND)) and back.n_expert == 4
    assert back.expert_bytes.tolist() == [100, 10] and back.ubatch is None
    # with ubatch, as a Session records it (dict with meta as a JSON string): written and read back
    d = dict(experts=hand.experts, layers=hand.layers, phase=hand.phase, expert_bytes=hand.expert_bytes,
             n_expert=np.int64(4), meta='{"k": 2}', ubatch=np.array([0, 0, 0, 1, 2, 3], np.int32))
    RouteLog.from_dict(d).save(tmp_path / "sub" / "u.npz")
    z = np.load(tmp_path / "sub" / "u.npz")
    assert z["ubatch"].dtype == np.int32 and z["ubatch"].tolist() == [0, 0, 0, 1, 2, 3]
    back = RouteLog.load(tmp_path / "sub" / "u.npz")
    assert back.ubatch.tolist() == [0, 0, 0, 1, 2, 3] and back.meta == {"k": 2}
    with pytest.raises(RouteLogError, match="lacks n_expert"):
        RouteLog.from_dict({k: v for k, v in d.items() if k != "n_expert"})


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.update(experts=d["experts"].astype(np.int64)), "int32"),
    (lambda d: d.update(experts=d["experts"][0]), r"\[T, L, k\]"),
    (lambda d: d.update(phase=np.zeros(5, np.uint8)), "phase"),
    (lambda d: d.update(expert_bytes=np.zeros(2, np.int32)), "expert_bytes"),
    (lambda d: d.update(layers=np.zeros(3, np.int32)), "layers"),
    (lambda d: d.update(n_expert=3), "id 3 >= n_expert = 3"),
    (lambda d: d["experts"].__setitem__((2, 1), [1, 1]), "same expert twice"),
    (lambda d: d["experts"].__setitem__((2, 1), [-1, -1]), "not routed"),
    (lambda d: d.update(ubatch=np.zeros(5, np.int32)), "ubatch"),
    (lambda d: d.update(ubatch=np.zeros(6, np.int64)), "ubatch"),
])
def test_validation_errors(hand, mutate, match):
    d = dict(experts=hand.experts.copy(), layers=hand.layers, phase=hand.phase, expert_bytes=hand.expert_bytes,
             n_expert=4)
    mutate(d)
    with pytest.raises(RouteLogError, match=match):
        RouteLog(**d)


def test_load_missing_array(tmp_path):
    p = tmp_path / "bad.npz"
    np.savez(p, experts=np.zeros((1, 1, 1), np.int32))
    with pytest.raises(RouteLogError, match="lacks array"):
        RouteLog.load(p)
    with pytest.raises(RouteLogError, match="does not exist"):
        RouteLog.load(tmp_path / "nope.npz")


# ---------------------------------------------------------------------------------------- analyses
def test_reuse_distances_by_hand(hand):
    d = reuse_distances(hand)
    # layer 0: t1 expert 0 last at t0 -> 1; t2 expert 1 last at t0 -> 2; t5 expert 1 last at t3 -> 2
    assert d[:, 0].tolist() == [[0, 0], [1, 0], [2, 1], [2, 1], [0, 1], [1, 2]]
    # layer 1: t5 experts 0, 1 last at t2 -> 3
    assert d[:, 1].tolist() == [[0, 0], [1, 1], [1, 1], [0, 0], [1, 1], [3, 3]]
    h = reuse_histogram(hand).set_index("distance")
    # first touches 4 + 4; distance 1: 5 + 6; distance 2: 3 + 0; distance 3: 0 + 2
    assert h["requests"].to_dict() == {0: 8, 1: 11, 2: 3, 3: 2}
    assert h.loc[3, "cum_share"] == pytest.approx(16 / 24)


def test_one_off_share_by_hand(hand):
    # windows t0-2 and t3-5: only layer 1's experts 0 and 1 at t5 occur once in their window
    assert one_off_share(hand, 3) == pytest.approx(2 / 24)
    # one window of 6: every (layer, expert) occurs at least twice
    assert one_off_share(hand, 6) == 0.0


def test_union_by_hand(hand):
    u = union_sizes(hand, ks=[1, 2]).set_index("k")
    # U(2): layer 0 windows {012}{012}{012}{013}{013} -> 3; layer 1: 2,2,4,2,4 -> 2.8; mean 2.9
    assert u.loc[1, "union"] == pytest.approx(2.0)
    assert u.loc[2, "union"] == pytest.approx(2.9)
    assert u.loc[2, "saving"] == pytest.approx(1 - 2.9 / 4)
    assert u.loc[1, "saving"] == pytest.approx(0.0)


def test_popularity_by_hand(hand):
    p = popularity(hand, ns=[1, 2]).set_index("n")
    # counts per layer: 4,4,2,2 -> top-1 8/24, top-2 16/24
    assert p.loc[1, "top_share"] == pytest.approx(1 / 3)
    assert p.loc[2, "top_share"] == pytest.approx(2 / 3)
    # pins from t0-2: expert 0 in both layers (ties -> lowest id); t3-5 has 2 of 6 (layer 0) + 1 of 6 (layer 1)
    assert p.loc[1, "hot_set_hit_rate"] == pytest.approx(3 / 12)


# -------------------------------------------------------------------------------------- simulators
def test_simulate_by_hand(hand):
    df = simulate(hand, [2, 3]).set_index(["policy", "capacity"])
    # capacity 2 = k: residents are the previous token's pair; hits = overlap with it: 5 (layer 0) + 6 (layer 1)
    # capacity 3 (worked step by step): layer 0 only first touches miss (4); layer 1 misses 0,1 at t0, 2,3 at t3
    # and 0 at t5 (t3 evicted LRU expert 0; Belady keeps 0 and evicts 1, then misses 1 at t5): 5 either way
    for pol in ("lru", "ls", "ls_pos", "belady"):
        assert df.loc[(pol, 2), "hits"] == 11 and df.loc[(pol, 2), "misses"] == 13, pol
        assert df.loc[(pol, 3), "hits"] == 15 and df.loc[(pol, 3), "misses"] == 9, pol
    # bytes: capacity 3: layer 0 misses 4 x 100 + layer 1 misses 5 x 10
    assert df.loc[("lru", 3), "bytes_read"] == 450
    # evictions = misses - loads into free slots (3 per layer): 4-3 + 5-3
    assert df.loc[("lru", 3), "evictions"] == 3
    ref = simulate_reference(hand, 3, "belady")
    assert (ref["hits"], ref["misses"], ref["misses_by_layer"]) == (15, 9, [4, 5])


def test_belady_beats_lru_by_hand():
    # one layer, k=1, 2 slots, trace 0 1 2 0 1: LRU misses all 5; MIN evicts 1 at t2 (next use farther), hits 0
    log = RouteLog.from_arrays([[[e]] for e in [0, 1, 2, 0, 1]], n_expert=3)
    df = simulate(log, [2]).set_index("policy")
    assert df.loc["lru", "misses"] == 5
    assert df.loc["belady", "misses"] == 4
    assert df.loc["lru", "gap_to_belady"] == pytest.approx(1 / 5)
    assert simulate_reference(log, 2, "belady")["misses"] == 4


def test_shared_pool_by_hand():
    # 2 layers, k=1, 3 shared slots. Tokens: L0 a0, L1 b0 | L0 a1, L1 b0 | L0 a0, L1 b1 (a = layer 0, b = layer 1)
    # t1 L0 a1 misses with a0, b0 resident: free slot.  t2 L1 b1 misses, pool {a0,a1,b0} full, pinned b1.
    #   lru victim: oldest last use: a1 (t1) vs b0 (t1, later) vs a0 (t2, current) -> a1.
    #   ls: stale {a1, b0} (a0 current): lowest layer first -> a1.   ls_pos (L=1): stale-left a1 first -> a1.
    #   belady: none used again -> lowest (layer, expert) = a0.
    log = RouteLog.from_arrays([[[0], [0]], [[1], [0]], [[0], [1]]], n_expert=2)
    for pol in ("lru", "ls", "ls_pos", "belady"):
        r = simulate_reference(log, 3, pol, per_layer=False)
        assert (r["hits"], r["misses"], r["evictions"]) == (2, 4, 1), pol
        want = "current_left" if pol == "belady" else "stale_left"
        assert r["evictions_by_group"][want] == 1, pol
    df = simulate(log, [3], per_layer=False).set_index("policy")
    assert df["misses"].tolist() == [4, 4, 4, 4]
    assert df.loc["ls_pos", "ev_stale_left"] == 1


def test_capacity_below_k_is_an_error(hand):
    with pytest.raises(ValueError, match="< k = 2"):
        simulate(hand, [1])


# ---------------------------------------------------------------------------------------- properties
@st.composite
def logs(draw):
    T = draw(st.integers(1, 8))
    L = draw(st.integers(1, 3))
    E = draw(st.integers(2, 6))
    k = draw(st.integers(1, min(3, E)))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    ex = np.array([[rng.permutation(E)[:k] for _ in range(L)] for _ in range(T)])
    return RouteLog.from_arrays(ex, n_expert=E, expert_bytes=rng.integers(1, 100, L))


PROP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROP
@given(logs(), st.booleans())
def test_belady_is_best_and_monotone(log, per_layer):
    hi = log.n_expert * (1 if per_layer else log.n_layers)
    caps = list(range(log.k, hi + 2))
    df = simulate(log, caps, per_layer=per_layer)
    best = df[df.policy == "belady"].set_index("capacity")["hits"]
    for _, r in df.iterrows():
        assert r.hits <= best[r.capacity], (r.policy, r.capacity)
    for pol in ("lru", "belady"):
        h = df[df.policy == pol].sort_values("capacity")["hits"].to_numpy()
        assert (np.diff(h) >= 0).all(), pol
    # everything fits: only first touches miss
    first = sum(len(np.unique(log.experts[:, l])) for l in range(log.n_layers))
    assert (df[df.capacity == hi + 1]["misses"] == first).all()


@PROP
@given(logs(), st.booleans(), st.integers(0, 2**31 - 1))
def test_relabelling_invariance(log, per_layer, seed):
    rng = np.random.default_rng(seed)
    perm = np.stack([rng.permutation(log.n_expert) for _ in range(log.n_layers)])   # [L, E]
    ex = perm[np.arange(log.n_layers)[None, :, None], log.experts]
    other = RouteLog.from_arrays(ex, n_expert=log.n_expert, expert_bytes=log.expert_bytes)
    caps = [log.k, log.k + 1, log.k + 3]
    a = simulate(log, caps, per_layer=per_layer)
    b = simulate(other, caps, per_layer=per_layer)
    assert a["hits"].tolist() == b["hits"].tolist()
    assert a["bytes_read"].tolist() == b["bytes_read"].tolist()
    assert union_sizes(log)["union"].tolist() == pytest.approx(union_sizes(other)["union"].tolist())


@PROP
@given(logs(), st.booleans())
def test_fast_matches_reference(log, per_layer):
    caps = sorted({log.k, log.k + 1, log.k + 2, log.n_expert * log.n_layers})
    df = simulate(log, caps, per_layer=per_layer)
    for _, r in df.iterrows():
        ref = simulate_reference(log, int(r.capacity), r.policy, per_layer=per_layer)
        assert (r.hits, r.misses, r.evictions, r.bytes_read) == \
            (ref["hits"], ref["misses"], ref["evictions"], ref["bytes_read"]), (r.policy, r.capacity)
        for g, n in ref["evictions_by_group"].items():
            if not np.isnan(r[f"ev_{g}"]):
                assert r[f"ev_{g}"] == n, (r.policy, r.capacity, g)


def test_fast_matches_reference_synthetic():
    log = RouteLog.synthetic(40, 4, 12, 3, locality=0.5, seed=3)
    for per_layer, caps in ((True, [3, 5, 8]), (False, [3, 10, 24])):
        df = simulate(log, caps, per_layer=per_layer)
        for _, r in df.iterrows():
            ref = simulate_reference(log, int(r.capacity), r.policy, per_layer=per_layer)
            assert r.misses == ref["misses"], (per_layer, r.policy, r.capacity)


def test_synthetic_locality():
    # locality 1: each token repeats the previous token's set, so only token 0 misses at capacity k
    log = RouteLog.synthetic(20, 3, 16, 4, locality=1.0, seed=1)
    assert all(set(log.experts[t, l]) == set(log.experts[0, l]) for t in range(20) for l in range(3))
    df = simulate(log, [4]).set_index("policy")
    assert df.loc["lru", "misses"] == 3 * 4


def test_routes_package_never_imports_the_engine():
    """epqlab.routes reads and analyses logs only: no module of it imports the Session, the native extension,
    the pager or the recorder (epqlab.studies.route_recording), even inside a function."""
    import ast
    from pathlib import Path

    import epqlab.routes

    engine = {"session", "_native", "pager", "strict", "strict_child", "route_recording", "models", "ablation"}
    for f in Path(epqlab.routes.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                mods = [("." * node.level) + (node.module or "")] + [
                    ("." * node.level) + (node.module + "." if node.module else "") + a.name for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            for m in mods:
                parts = m.lstrip(".").split(".") if m.startswith("..") else (
                    m.split(".")[1:] if m.startswith("epqlab.") else [])
                assert not (parts and parts[0] in engine), f"{f.name}:{node.lineno} imports {m}"

