"""ram_budget="auto": the rule of epqlab/auto_budget.py checked with hand-made readings, the cgroup reader on
a fake cgroup-v2 tree, and the CLI printing what it chose."""
from __future__ import annotations

import types

import pytest

import epqlab
from epqlab.memory import auto_budget as ab

GiB = 2**30


def _fake(monkeypatch, avail, cgroup, rss):
    monkeypatch.setattr(ab, "mem_available", lambda: avail)
    monkeypatch.setattr(ab, "cgroup_headroom", lambda: cgroup)
    monkeypatch.setattr(ab, "sample", lambda: types.SimpleNamespace(total=rss))


def test_rule_by_hand(monkeypatch):
    _fake(monkeypatch, 10 * GiB, None, 1 * GiB)  # no cgroup limit: MemAvailable + own RSS, minus 10 %
    b = ab.auto_budget()
    assert (b.source, b.available, b.margin, b.budget) == ("MemAvailable", 11 * GiB, int(1.1 * GiB), 11 * GiB - int(1.1 * GiB))
    _fake(monkeypatch, 10 * GiB, (3 * GiB, "cgroup-v2"), GiB // 2)  # a tighter cgroup wins
    b = ab.auto_budget()
    assert (b.source, b.available, b.budget) == ("cgroup-v2", 3.5 * GiB, 3.5 * GiB - int(0.35 * GiB))
    _fake(monkeypatch, 1 * GiB, (3 * GiB, "cgroup-v1"), 0)  # a looser cgroup does not; the margin floor is 256 MiB
    b = ab.auto_budget()
    assert (b.source, b.budget) == ("MemAvailable", GiB - 256 * 2**20)
    assert "ram_budget auto = " in b.describe()


def test_cgroup_v2_reader(monkeypatch, tmp_path):
    root = tmp_path / "cg"
    leaf = root / "a" / "b"
    leaf.mkdir(parents=True)
    (root / "a" / "memory.max").write_text(f"{4 * GiB}\n")
    (root / "a" / "memory.current").write_text(f"{3 * GiB}\n")
    (leaf / "memory.max").write_text("max\n")  # no limit of its own: the parent's applies
    (leaf / "memory.current").write_text(f"{GiB}\n")
    monkeypatch.setattr(ab, "_mounts", lambda: [(str(root), "cgroup2", "rw")])
    real_read = ab.Path.read_text
    monkeypatch.setattr(ab.Path, "read_text", lambda self, *a, **k: "0::/a/b\n" if str(self) == "/proc/self/cgroup"
                        else real_read(self, *a, **k))
    assert ab.cgroup_headroom() == (GiB, "cgroup-v2")
    # clean page cache on the inactive list is reclaimable: room, not use (4 GiB - (3 GiB - 0.5 GiB))
    (root / "a" / "memory.stat").write_text(f"anon 100\ninactive_file {GiB // 2}\nactive_file 7\n")
    assert ab.cgroup_headroom() == (GiB + GiB // 2, "cgroup-v2")


def test_session_and_cli_auto(default_model_path, capsys):
    with epqlab.Session(default_model_path, ram_budget="auto", n_threads=1, n_ctx=256) as s:
        assert s.auto_budget is not None and s.budget_bytes == s.auto_budget.budget
        assert s.memory_parts()["budget"] == s.auto_budget.budget
    from epqlab.cli import main

    assert main(["run", str(default_model_path), "-n", "2", "--ram-budget", "auto", "--threads", "1", "--n-ctx", "256"]) == 0
    assert "epqlab: ram_budget auto = " in capsys.readouterr().err


def test_default_budget_turns_auto_when_the_model_does_not_fit(default_model_path, monkeypatch):
    """ram_budget=None means "every expert in the arena" only while the model file fits what auto allows;
    a (pretend) machine with less than the file's size gets the auto budget instead: here one too small
    to run, so the refusal names it."""
    size = default_model_path.stat().st_size
    small = ab.AutoBudget(budget=size // 2, source="MemAvailable", available=size, margin=size // 2)
    monkeypatch.setattr(ab, "auto_budget", lambda: small)
    with pytest.raises(epqlab.ArenaTooSmall, match=f"ram_budget {epqlab.fmt_bytes(size // 2)}"):
        epqlab.Session(default_model_path, n_threads=1, n_ctx=256)
    monkeypatch.setattr(ab, "auto_budget", lambda: ab.AutoBudget(budget=100 * size, source="MemAvailable",
                                                                 available=100 * size, margin=0))
    with epqlab.Session(default_model_path, n_threads=1, n_ctx=256) as s:  # fits: all experts, no budget
        assert s.budget_bytes is None and s.auto_budget is None


def test_budget_above_the_machine_is_refused(monkeypatch, mini_gguf):
    """A cgroup with 2 GiB of headroom, this process holding 0.5 GiB: a budget of 1 TiB (or 2.6 GiB) would be
    killed by the kernel once the arena fills, so the Session refuses it with the numbers and the auto value
    (2.5 GiB available - 256 MiB margin); 2.4 GiB passes the check."""
    _fake(monkeypatch, 10 * GiB, (2 * GiB, "cgroup-v1"), GiB // 2)
    for budget in ("1TiB", int(2.6 * GiB)):
        with pytest.raises(epqlab.BudgetTooLargeError, match=r"2\.50 GiB available \(cgroup-v1.*'auto' \(2\.25 GiB"):
            epqlab.Session(mini_gguf, ram_budget=budget, n_threads=1)
    ab.check_budget(int(2.4 * GiB))  # below what is available: no error
