"""Eviction policies, replay and the eviction ablation.

Expected hit counts on the cyclic log are worked out by hand in the comments (not by running a
second implementation); live == replay compares a live Session's counters with a replay done here.
"""
from __future__ import annotations

import numpy as np
import pytest

import epqlab
from epqlab.studies.ablation import hot_experts, memory_points
from epqlab.studies.ablation.grid import pass_rates

from ggufs import LayerSpec, write_moe


@pytest.fixture(scope="module")
def cyc(tmp_path_factory):
    """4 MoE layers x 4 experts, top-2; F32 128x16 matrices at 4096 alignment (2 pages each, so one
    class of 24 KiB units)."""
    path = tmp_path_factory.mktemp("cyc") / "cyc.gguf"
    write_moe(path, [LayerSpec(i, "F32", 128, 16) for i in range(4)], n_expert=4, n_expert_used=2, alignment=4096)
    return epqlab.inspect(path)


def cyclic_log(T=5, L=4):
    """Every token routes every layer to experts (0, 1): 8 distinct units per token."""
    return np.tile(np.array([0, 1], np.int32), (T, L, 1))


# Hand-worked hits on cyclic_log(5) with 6 slots (< L*k = 8), one token per forward pass:
#  lru:    a cycle over 8 units in 6 slots evicts each unit before its reuse: 0.
#  ls:     evicts the smallest stale layer, i.e. the next one needed: 0.
#  lfu:    counts tie within a token, so the older unit goes first, as in LRU: 0.
#  ls_pos: token 1 fills L0-L2, L3 evicts current-left L2. Token 2: L0, L1 hit, L2 evicts L1,
#          L3 hits (6). Token 3: L1 evicts L0, L2 and L3 hit (6). Token 4: L0 evicts stale-right
#          L3, L1 and L2 hit, L3 evicts L2 (4). Token 5 repeats token 2 (6): 0+6+6+4+6 = 22.
#  belady: farthest next use evicts the same units here (the cycle is its worst case): 22.
#  static with L0 hot: L0 always hits, the rest cycles as LRU over 6 units in 4 slots: 4 x 2 = 8.
HAND = {"lru": 0, "ls": 0, "lfu": 0, "ls_pos": 22, "belady": 22}


@pytest.mark.parametrize("policy", sorted(HAND))
def test_cyclic_log_hits_by_hand(cyc, policy):
    unit = epqlab.Pager.unit_slot_bytes(cyc)[0]
    p = epqlab.Pager(cyc, 6 * unit, policy=policy)
    assert p.n_slots == 6
    st = p.replay(cyclic_log())
    assert st["requests"] == 40
    assert st["hits"] == HAND[policy]
    req, hit = p.pass_history()
    assert req.tolist() == [8] * 5 and int(hit.sum()) == HAND[policy]


def test_static_hot_layer_by_hand(cyc):
    unit = epqlab.Pager.unit_slot_bytes(cyc)[0]
    p = epqlab.Pager(cyc, 6 * unit, policy="static")
    p.set_hot([[cyc.moe_layers[0], 0], [cyc.moe_layers[0], 1]])
    st = p.replay(cyclic_log())
    assert st["hits"] == 8
    assert p.pass_history()[1].tolist() == [0, 2, 2, 2, 2]
    with pytest.raises(ValueError, match="static"):
        epqlab.Pager(cyc, 6 * unit, policy="lru").set_hot([[0, 0]])


def test_fnu_between_lru_and_belady_on_cycle(cyc):
    unit = epqlab.Pager.unit_slot_bytes(cyc)[0]
    fnu = epqlab.Pager(cyc, 6 * unit, policy="fnu").replay(cyclic_log(20))["hits"]
    bel = epqlab.Pager(cyc, 6 * unit, policy="belady").replay(cyclic_log(20))["hits"]
    assert 0 < fnu <= bel


def test_replay_follows_ubatches_and_staging(cyc):
    """Two ubatches: tokens 0-2 (one pass) then token 3. With 3 slots (capacity 3), a layer whose
    3-token union has 4 experts is staged (no request); a union of 2 is one request per expert."""
    unit = epqlab.Pager.unit_slot_bytes(cyc)[0]
    p = epqlab.Pager(cyc, 3 * unit, policy="lru")
    ex = np.zeros((4, 4, 2), np.int32)
    ex[:3, :, :] = [0, 1]                     # union {0, 1} in every layer ...
    ex[1, 2, :] = [2, 3]                      # ... except layer 2: union {0, 1, 2, 3} > 3 slots -> staged
    ex[3, :, :] = [1, 0]                      # the single-token pass: router order 1, 0
    ex[3, 3, :] = -1                          # token 3 not routed through the last layer
    st = p.replay({"experts": ex, "layers": np.array(cyc.moe_layers), "ubatch": np.array([0, 0, 0, 1])})
    # Pass 1: L0 {0,1} fills 2 slots; L1 {0,1} takes the last slot and evicts L0e0 (LRU); L2 is
    # staged (4 experts > 3 slots: no request); L3 {0,1} evicts L0e1 and L1e0 -> L1e1, L3e0, L3e1.
    # Pass 2 (token 3 alone, router order 1, 0): L0 evicts L1e1, L3e0; L1 evicts L3e1, L0e1; L2
    # evicts L0e0, L1e1; L3 not routed. Requests 6 + 6, no hits, evictions 3 + 6.
    assert p.pass_history()[0].tolist() == [6, 6]
    assert (st["requests"], st["hits"], st["evictions"], st["passes"]) == (12, 0, 9, 2)
    # Left resident: L2e1, L2e0 and L1e0. Router order made L1e1 the older of L1's pair, so L2's
    # second miss evicted it; a sorted request (0, 1) would have evicted L1e0 instead.
    assert p.is_resident(cyc.moe_layers[2], 0) and p.is_resident(cyc.moe_layers[2], 1)
    assert p.is_resident(cyc.moe_layers[1], 0) and not p.is_resident(cyc.moe_layers[1], 1)


def test_belady_never_below_online(cyc):
    rng = np.random.default_rng(1)
    unit = epqlab.Pager.unit_slot_bytes(cyc)[0]
    # Skewed random routes: expert 0 half the time, so reuse exists.
    ex = np.stack([rng.choice(4, size=2, replace=False, p=[0.5, 0.2, 0.2, 0.1]) for _ in range(60 * 4)])
    ex = ex.reshape(60, 4, 2).astype(np.int32)
    pr = rng.random(ex.shape).astype(np.float32)  # router probabilities: gate_rank weighs by them
    for slots in (2, 4, 6, 10):
        bel = epqlab.Pager(cyc, slots * unit, policy="belady").replay(ex)["hits"]
        for pol in epqlab.paging.pager.POLICIES:
            assert epqlab.Pager(cyc, slots * unit, policy=pol).replay(ex, probs=pr)["hits"] <= bel, (slots, pol)


def test_hot_experts_by_hand():
    ex = np.array([[[0, 1], [2, 3]], [[0, 2], [2, -1]], [[0, 1], [3, 2]]], np.int32)  # T=3, L=2, k=2
    # layer A (block 5): 0 x3, 1 x2, 2 x1; layer B (block 7): 2 x3, 3 x2
    hot = hot_experts({"experts": ex, "layers": np.array([5, 7]), "n_expert": 4}, 3)
    assert hot.tolist() == [[5, 0], [7, 2], [5, 1]]


def test_memory_points_and_pass_rates(cyc):
    pts = memory_points(cyc, arenas=[0.5, "64KiB"], budgets=["1GiB"])
    full = epqlab.Pager.all_experts_bytes(cyc)
    assert pts[0].session_kwargs() == {"arena_bytes": round(0.5 * full)}
    assert pts[1].arena_bytes == 65536 and pts[2].session_kwargs() == {"ram_budget": 2**30}
    with pytest.raises(ValueError, match="smallest arena"):
        memory_points(cyc, arenas=[0.01])
    r = pass_rates((np.array([8, 4, 4, 4]), np.array([0, 1, 2, 4])), np.array([0, 1, 2, 2]))
    assert r["hit_rate"] == 7 / 20 and r["decode_hit_rate"] == 7 / 12 and r["steady_hit_rate"] == 6 / 8


def test_session_refuses_offline_policy(default_model_path):
    with pytest.raises(ValueError, match="replay"):
        epqlab.Session(default_model_path, policy="belady")
    with pytest.raises(ValueError, match="static"):
        epqlab.Session(default_model_path, policy="lru", hot_experts=[[1, 0]])


@pytest.mark.parametrize("policy", epqlab.paging.pager.POLICIES)
def test_live_equals_replay(default_model_path, tmp_path, policy):
    """A live run (prefill ubatches + decode) and the replay of its own route log through a fresh
    pager of the same arena agree on every counter, per forward pass too."""
    lay = epqlab.inspect(default_model_path)
    arena = int(0.3 * epqlab.Pager.all_experts_bytes(lay))
    hot = np.array([[b, e] for b in lay.moe_layers[:6] for e in range(2)]) if policy == "static" else None
    with epqlab.Session(default_model_path, arena_bytes=arena, policy=policy, route_log=tmp_path / "r.npz",
                        hot_experts=hot, n_ubatch=4, n_batch=4) as s:
        for prompt in ("A CPU cache is a small, fast memory that", "def fibonacci(n):"):
            s.generate(prompt, 6)
        live, hist, log = s.stats, s.pager.pass_history(), s.route_log()
    assert len(set(log.ubatch.tolist())) < log.n_tokens  # multi-token ubatches were logged
    p = epqlab.Pager(lay, arena, policy=policy)
    if hot is not None:
        p.set_hot(hot)
    rep = p.replay(log)
    for c in ("requests", "hits", "misses", "evictions", "evictions_stale_left", "evictions_current_left",
              "evictions_stale_right", "evictions_current_right", "bytes_read"):
        assert rep[c] == live[c], c
    assert [a.tolist() for a in p.pass_history()] == [a.tolist() for a in hist]
    assert live["requests"] > 0 and live["evictions"] > 0


@pytest.mark.slow
def test_notebook_03_defaults(default_model_path, tmp_path):
    """notebooks/03_least_stale.ipynb with its defaults under papermill (the user's entry point: preset "quick",
    a few minutes on 2 cores): the preset's settings ran, every replay matched its live run, the share and gap to
    Belady are what the hit rates give, and the saved notebook shows what a reader needs (the progress bar's final
    state, two narrow tables, a reading with one item per arena)."""
    import json
    import os
    import re
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from epqlab.studies.ablation import DEFAULT_POLICIES, EVICTION_PRESETS
    from notebooks import run_notebook

    r = run_notebook("03_least_stale", {}, tmp_path, cell_timeout=1500)  # its one long cell, on a busy box
    quick = EVICTION_PRESETS["quick"]
    p = r["parameters"]
    assert p["preset"] == "quick" and p["policies"] == list(DEFAULT_POLICIES)
    assert {k: p[k] for k in quick} == quick
    rows = r["rows"]
    assert len(rows) == len(quick["arenas"]) * len(DEFAULT_POLICIES)
    assert {x["arena_fraction"] for x in rows} == set(quick["arenas"])
    for x in rows:
        assert x["replay_equal"] is True and x["repeats"] == 1
        assert 0 <= x["hit_rate"] <= x["belady_hit_rate"] <= 1
        assert x["belady_share"] == pytest.approx(x["hit_rate"] / x["belady_hit_rate"])
        assert x["belady_gap"] == pytest.approx(x["belady_hit_rate"] - x["hit_rate"])
        assert x["steady_belady_gap"] == pytest.approx(x["belady_steady_hit_rate"] - x["steady_hit_rate"])
    assert r["python"] == sys.executable
    assert len(r["figures"]) == 4 and all(os.path.getsize(f) > 1000 for f in r["figures"])
    assert any(f.endswith("decode_speed_and_reads.png") for f in r["figures"])
    cap = r["routing_cap"]
    assert len(cap) == len(quick["arenas"])
    for c in cap:  # the uniform reference obeys its bound; the model's numbers are the live table's
        assert c["uniform_best_online"] <= c["uniform_bound"] + 0.05 < c["uniform_belady"] + 0.05
        live = [x["hit_rate"] for x in rows if x["point"] == c["point"]]
        assert c["model_best_online"] == pytest.approx(max(live))

    nb = json.loads((tmp_path / "03_least_stale.out.ipynb").read_text())
    outs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    assert not any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outs)
    text = lambda v: "".join(v) if isinstance(v, list) else v  # noqa: E731 (nbformat keeps text as lines)
    bar = "".join(text(o["text"]) for o in outs if o.get("name") == "stderr" and "eviction ablation" in text(o["text"]))
    n = len(rows)
    assert bar.replace("\r", "\n").strip().splitlines()[-1].count(f"{n}/{n}") == 1, bar[-300:]
    tables = [text(o["data"]["text/html"]) for o in outs if "text/html" in o.get("data", {})]
    heads = [len(re.findall(r"<th[ >]", t.split("</thead>")[0])) - 1 for t in tables[:2]]  # less the index
    assert max(heads) <= 10, heads  # no table wide enough to hide columns behind a scrollbar
    md = [text(o["data"]["text/markdown"]) for o in outs if "text/markdown" in o.get("data", {})]
    items = [l for l in md[-1].splitlines() if l.startswith("- **")]
    assert [l.split("**")[1] for l in items] == [f"arena {a:.0%}" for a in quick["arenas"]]


def test_cli_ablate_eviction(default_model_path, tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "ev.json"
    r = subprocess.run([sys.executable, "-m", "epqlab", "ablate", "eviction", str(default_model_path), "--arenas", "0.4",
                        "--policies", "lru,fnu", "--prompts", "prose-story", "-n", "5", "--repeats", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "best online policy" in r.stdout and "Replay" in r.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [x["policy"] for x in rows] == ["lru", "fnu"] and all(x["replay_equal"] for x in rows)
    bad = subprocess.run([sys.executable, "-m", "epqlab", "ablate", "eviction", str(default_model_path),
                          "--policies", "belady"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "epqlab: error:" in bad.stderr and "Traceback" not in bad.stderr


def test_uniform_routes_shape():
    from epqlab.studies.ablation.routing_cap import uniform_routes

    ex = np.zeros((50, 3, 2), np.int32)
    ex[7, 1] = -1
    u = uniform_routes(ex, 5, seed=1)
    assert u.shape == ex.shape and u.dtype == np.int32
    assert (u[7, 1] == -1).all() and (np.delete(u.reshape(-1, 2), 7 * 3 + 1, axis=0) >= 0).all()
    rows = u.reshape(-1, 2)
    ok = rows[:, 0] >= 0
    assert (rows[ok, 0] != rows[ok, 1]).all() and rows.max() < 5
    # every id about equally often: 149 routed rows x 2 picks over 5 ids (expected 59.6 each)
    assert np.bincount(rows[ok].ravel(), minlength=5).min() > 35
    with pytest.raises(ValueError, match="exceeds n_expert"):
        uniform_routes(ex, 1)


def test_online_policies_capped_on_uniform_routes(default_model_path, fraction=0.3):
    """On i.i.d. uniform routes no online policy can beat slots / (L x E) in expectation (each requested
    expert is resident with probability r_l / E, and the r_l sum to at most the slot count; see
    epqlab.studies.ablation.routing_cap). Belady, which sees the future, must beat it clearly."""
    from epqlab.studies.ablation.routing_cap import uniform_routes

    lay = epqlab.inspect(default_model_path)
    L, E, k = len(lay.moe_layers), lay.n_expert, lay.n_expert_used
    log = {"experts": uniform_routes(np.zeros((150, L, k), np.int32), E, seed=3), "layers": np.array(lay.moe_layers)}
    arena = int(fraction * epqlab.Pager.all_experts_bytes(lay))
    rate = {}
    for pol in ("lru", "ls_pos", "lfu", "fnu", "belady"):
        p = epqlab.Pager(lay, arena, policy=pol)
        st = p.replay(log)
        rate[pol] = st["hits"] / st["requests"]
    bound = p.n_slots / (L * E)
    for pol, r in rate.items():
        if pol != "belady":
            assert r <= bound + 0.02, (pol, r, bound)  # 13500 requests: sampling sd ~0.4 %
    assert rate["belady"] > bound + 0.15, (rate, bound)


def test_arena_above_one_is_bytes_and_says_so(default_model_path):
    """A sweep's arena above 1 is a byte count: ``arenas=[2.0]`` asks for 2 bytes, and the refusal says so and
    names the fraction form (fractions lie in (0, 1])."""
    from epqlab.studies.ablation.grid import memory_points

    lay = epqlab.inspect(default_model_path)
    with pytest.raises(ValueError, match=r"2\.0 means 2 bytes; fractions of all expert slots lie in \(0, 1\]"):
        memory_points(lay, [2.0])
    with pytest.raises(ValueError, match="cannot hold") as e:
        memory_points(lay, ["2KiB"])
    assert "means" not in str(e.value)  # a size with a unit is plainly bytes
    assert memory_points(lay, [0.5])[0].arena_fraction == 0.5
