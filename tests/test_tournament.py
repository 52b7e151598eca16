"""The eviction tournament (``epqlab ablate policies``) on the default model, CI-sized: its scores recomputed
here from the hit counts of independent runs (the native pager's replay of the tournament's own route log for
LRU and Belady), the live confirmation's counts equal the simulation, bad input refused."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import epqlab
from epqlab.data import heldout_texts
from epqlab.studies.ablation.grid import memory_points
from epqlab.routes.online import simulate_online
from epqlab.studies.ablation.tournament import record_routes, tournament


def test_cli_tournament(default_model_path, tmp_path):
    out = tmp_path / "t.json"
    txt = tmp_path / "text.txt"
    txt.write_text(heldout_texts()["code"])
    r = subprocess.run([sys.executable, "-m", "epqlab", "ablate", "policies", str(default_model_path), "--budgets", "0.6",
                        "--text", str(txt), "-n", "24", "--policies", "lru,fnu,arc,sieve", "--confirm", "2",
                        "--simulator", "python",
                        "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "best online policy" in r.stdout and "equal the simulation in every one" in r.stdout
    d = json.loads(out.read_text())
    rows = d["rows"]
    sim = {x["policy"]: x for x in rows if x["kind"] == "sim"}
    assert set(sim) == {"lru", "fnu", "arc", "sieve", "belady"}
    live = [x for x in rows if x["kind"] == "live"]
    assert len(live) == 2 and all(x["live_equal"] for x in live)
    ranked = sorted((x for x in sim.values() if x["policy"] != "belady"), key=lambda x: x["rank"])
    assert [x["policy"] for x in live] == [x["policy"] for x in ranked[:2]]
    assert ranked[0]["hit_rate"] >= ranked[-1]["hit_rate"]

    # LRU and Belady by the native pager's replay of the same text's routes, gap shares recomputed from them
    lay = epqlab.inspect(default_model_path)
    log = record_routes(str(default_model_path), txt.read_text(), 24)
    arena = memory_points(lay, arenas=[0.6])[0].arena_bytes
    rate = {}
    for p in ("lru", "belady"):
        st = epqlab.Pager(lay, arena, policy=p, prefault=False).replay(log)
        rate[p] = st["hits"] / st["requests"]
    assert sim["lru"]["hit_rate"] == pytest.approx(rate["lru"]) and sim["belady"]["hit_rate"] == pytest.approx(rate["belady"])
    assert 0 < rate["lru"] < rate["belady"]   # so the gap share's denominator is not Belady's rate alone
    gap = rate["belady"] - rate["lru"]
    for x in sim.values():
        want = (x["hit_rate"] - rate["lru"]) / gap if gap > 1e-12 else None
        assert (x["gap_share"] is None and want is None) or x["gap_share"] == pytest.approx(want)
        assert len(x["layer_gap_share"]) == len(lay.moe_layers)
    assert sim["belady"]["gap_share"] == pytest.approx(1.0) and sim["lru"]["gap_share"] == pytest.approx(0.0)
    assert d["winners"][0]["policy"] == ranked[0]["policy"]


def test_tournament_prefetch_runs_live_only(default_model_path):
    """A prefetch mode other than off adds live rows (hit rates by timing: not compared) for the best policies;
    the per-layer table has one row per MoE layer."""
    from epqlab.studies.ablation.tournament import layer_table

    df = tournament(default_model_path, [0.5], policies=["lru", "fnu", "coact"], n_tokens=12,
                    prefetch=["off", "lookahead"], confirm=1, simulator="native")
    live = df[df.kind == "live"]
    best = df[(df.kind == "sim") & (df["rank"] == 1)].policy.iloc[0]
    assert sorted(live.prefetch) == ["lookahead", "off"] and set(live.policy) == {best}
    assert bool(live[live.prefetch == "off"].live_equal.all()) and live[live.prefetch == "lookahead"].live_equal.isna().all()
    lt = layer_table(df, df.point.iloc[0])
    assert list(lt.columns) == ["lru", "fnu", "coact"] and len(lt) == len(epqlab.inspect(default_model_path).moe_layers)


def test_tournament_refuses_bad_input(default_model_path):
    with pytest.raises(ValueError, match="choose among lru, ls"):
        tournament(default_model_path, [0.3], policies=["lru", "belady"])
    with pytest.raises(ValueError, match="needs predictor="):
        tournament(default_model_path, [0.3], policies=["lru"], prefetch=["off", "trained"])
    with pytest.raises(ValueError, match="simulator must be 'native' or 'python'"):
        tournament(default_model_path, [0.3], policies=["lru"], simulator="belady")
    with pytest.raises(ValueError, match="n_tokens must be >= 1"):
        tournament(default_model_path, [0.3], policies=["lru"], n_tokens=0)
    bad = subprocess.run([sys.executable, "-m", "epqlab", "ablate", "policies", str(default_model_path),
                          "--policies", "lru,clock"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "epqlab: error:" in bad.stderr and "Traceback" not in bad.stderr


def test_tournament_simulates_the_live_addressing(tiny_gguf):
    """On a model whose live Sessions address experts by slot (two slot classes; a unit keeps to its own class),
    the simulation and Belady run in slot mode too and the live runs reproduce the simulated counts; region-mode
    counts of the same routes differ, so a tournament that ignored the addressing would not match."""
    df = tournament(tiny_gguf, ["2000000"], policies=["lru", "heat", "lfu"], n_tokens=32, confirm=3,
                    text=heldout_texts()["code"])
    live = df[df.kind == "live"]
    assert set(df.addressing) == {"slots"} and len(live) == 3
    assert bool(live.live_equal.all()), live[["policy", "hit_rate"]]
    lay = epqlab.inspect(tiny_gguf)
    log = record_routes(str(tiny_gguf), heldout_texts()["code"], 32)
    classes = [(c["slot_bytes"], c["slots"]) for c in epqlab.Pager(lay, 2_000_000, prefault=False).stats["slot_classes"]]
    kw = dict(slot_classes=classes, unit_bytes=epqlab.Pager.unit_slot_bytes(lay))
    by_slot = [simulate_online(log, None, p, slot_mode=True, **kw)["hits"] for p in ("lru", "heat", "lfu")]
    by_region = [simulate_online(log, None, p, **kw)["hits"] for p in ("lru", "heat", "lfu")]
    assert by_slot != by_region
