"""epqlab.sweep: a small grid on local processes and on a Dask LocalCluster (2 worker processes) gives the
same rows; grids expand as documented."""
from __future__ import annotations

import os

import pytest

import epqlab
from epqlab.studies.sweeps import META, generation_point, grid_points

GRID = {"arena": [0.3, 0.7], "policy": ["lru"], "n_predict": [4]}
TIMING = ["decode_tok_s"]


def test_grid_points():
    assert grid_points({"a": [1, 2], "b": ["x", "y"]}) == [{"a": 1, "b": "x"}, {"a": 1, "b": "y"},
                                                           {"a": 2, "b": "x"}, {"a": 2, "b": "y"}]
    assert grid_points([{"a": 1}, {"a": [2, 3]}]) == [{"a": 1}, {"a": 2}, {"a": 3}]
    with pytest.raises(ValueError, match=r"wrap one value as \['lru'\]"):
        grid_points({"policy": "lru"})
    with pytest.raises(ValueError, match="dict of lists"):
        grid_points(42)


def test_sweep_local_equals_dask(default_model_path):
    distributed = pytest.importorskip("distributed")
    grid = {"model": [str(default_model_path)], **GRID}
    local = epqlab.sweep(generation_point, grid, progress=False)
    assert len(local) == 2 and list(local["run"]) == [0, 1]
    # the documented isolation: outside this process, one worker runs every point in turn (not a process per point)
    assert local.pid.nunique() == 1 and os.getpid() not in set(local.pid)
    assert list(local.columns[:4]) == ["model", "arena", "policy", "n_predict"] and set(META) <= set(local.columns)
    # the counts follow the arena: a larger arena never misses more on the same tokens
    by = local.set_index("arena")
    assert by.loc[0.7, "misses"] < by.loc[0.3, "misses"] and (local.hits + local.misses > 0).all()
    assert local.tokens.nunique() == 1  # paging never changes the tokens
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                  memory_limit="4GiB") as cluster, distributed.Client(cluster) as client:
        dask = epqlab.sweep(generation_point, grid, client.get_executor(), progress=False)
        assert dask.pid.nunique() >= 1 and set(dask.pid) != set(local.pid)
    drop = list(META) + TIMING
    assert dask.drop(columns=drop).equals(local.drop(columns=drop)), (local, dask)
