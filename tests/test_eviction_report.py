"""The eviction ablation's tables and reading (epqlab.studies.ablation.eviction_report) on a hand-made table: the
share and gap to Belady from the hit rates, rounded narrow tables, one reading item per memory point, and the
caveat when a policy reading fewer MB/token decodes slower."""
from __future__ import annotations

import pandas as pd
import pytest

from epqlab.studies.ablation import eviction_hit_table, eviction_reading, eviction_speed_table


def _row(point, frac, policy, steady, belady_steady, mb, tok_s, **kw):
    return {"point": point, "arena_fraction": frac, "policy": policy, "slots": 58, "hit_rate": steady * 0.8,
            "decode_hit_rate": steady * 0.9, "steady_hit_rate": steady, "belady_hit_rate": belady_steady * 0.8,
            "belady_steady_hit_rate": belady_steady, "misses_per_token": 10.0, "ssd_mb_per_token": mb,
            "decode_tok_s": tok_s, "decode_tok_s_min": tok_s, "decode_tok_s_max": tok_s, "io_wait_share": 0.1,
            "io_wait_s": 0.123456789, "replay_equal": True, "repeats": 1, **kw}


@pytest.fixture
def df():
    return pd.DataFrame([
        _row("arena 25%", 0.25, "lru", 0.0, 0.5, 7.0, 2.0),
        _row("arena 25%", 0.25, "fnu", 0.4, 0.5, 4.5, 3.0),   # fewer MB, faster: consistent
        _row("arena 50%", 0.5, "lru", 0.5, 0.8, 3.4, 3.8),
        _row("arena 50%", 0.5, "fnu", 0.6, 0.8, 2.6, 0.9),   # fewer MB, slower: the caveat
    ])


def test_tables_are_narrow_rounded_and_give_share_and_gap(df):
    hit, speed = eviction_hit_table(df), eviction_speed_table(df)
    assert len(hit.columns) <= 10 and len(speed.columns) <= 10
    assert {"decode_tok_s", "ssd_mb_per_token", "io_wait_s"} <= set(speed.columns)
    assert speed["io_wait_s"].tolist() == [0.123] * 4
    # fnu at 50%: 0.6 of 0.8 is 75% of the bound, 0.2 below it
    assert hit.loc[3, "steady_belady_share"] == 0.75 and hit.loc[3, "steady_belady_gap"] == 0.2
    assert hit.loc[0, "steady_belady_share"] == 0.0 and hit.loc[0, "steady_belady_gap"] == 0.5


def test_reading_is_a_list_with_a_caveat_where_speeds_contradict_bytes(df):
    text = eviction_reading(df)
    items = [l for l in text.splitlines() if l.startswith("- ")]
    assert [l.split("**")[1] for l in items] == ["arena 25%", "arena 50%"]
    assert "75% of the bound" in items[1] and "steady-state hit rate 60.0% vs Belady 80.0%" in items[1]
    assert "contradict the bytes: fnu reads fewer MB/token than LRU yet decodes slower" in items[1]
    assert "contradict" not in items[0]
    assert "reproduced its hits" in text.splitlines()[-1] and text.splitlines()[-2] == ""
