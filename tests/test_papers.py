"""``epqlab report`` / :func:`epqlab.papers.write_papers`: papers built from small results written here (01 on a
scratch file, 02 on a synthetic route log) and from a checked-in CLI result (tests/fixtures/papers/
03_synth3.json, from ``epqlab ablate eviction`` on an 8.9 GB synthesized model; its model path is made relative
there, ``big/q8s.gguf``, so the report does not hash an 8.9 GB file when it happens to exist). Numbers in the papers are
checked against values computed here from the raw fields, links against the files written."""
from __future__ import annotations

import hashlib
import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures" / "papers"


def _table(md: str, header_start: str) -> list[list[str]]:
    """Cells of the Markdown table whose header row starts with ``| header_start``."""
    lines = md.splitlines()
    i = next(i for i, l in enumerate(lines) if l.startswith("|") and l.strip("| ").startswith(header_start))
    rows = []
    for l in lines[i + 2:]:
        if not l.startswith("|"):
            break
        rows.append([c.strip() for c in l.strip("|").split("|")])
    return [[c.strip() for c in lines[i].strip("|").split("|")]] + rows


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from epqlab.paging.probe import probe_io
    from epqlab.studies.probe_report import probe_figure, save_probe_results
    from epqlab.results import run_info, save_figures, study_dir, write_json
    from epqlab.routes import RouteLog
    from epqlab.routes.report import make_figures, summarize

    tmp = tmp_path_factory.mktemp("papers")
    res = tmp / "results"
    # 01: a 2 MiB file stands for the model, so its hash is checkable
    model = tmp / "model.bin"
    model.write_bytes(np.random.default_rng(0).integers(0, 256, 2 << 20, dtype=np.uint8).tobytes())
    params01 = {"model": str(model), "sizes": [4096, 65536], "concurrency": [1, 2], "n_requests": 3,
                "direct": True, "scratch_bytes": "2GiB", "top_k": 2, "seed": 0}
    df = probe_io(str(model), request_bytes=[4096, 65536], concurrency=[1, 2], n_requests=3)
    save_probe_results(df, study_dir(res, "01_io_probe"), "tiny", parameters=params01, expert_bytes=65536, top_k=2,
                       elapsed_s=1.0, figure=probe_figure(df))
    # 02: synthetic log, as notebooks/02_route_overlap.ipynb writes it
    log = RouteLog.synthetic(n_tokens=24, n_layers=4, n_expert=16, k=2, locality=0.6, n_prefill=4, seed=1)
    summary = summarize(log, [2, 4, 16])
    out02 = study_dir(res, "02_route_overlap")
    summary["figures"] = save_figures(make_figures(summary), out02, "syn")
    # a figure far above the 200 KB limit (noise does not compress): the paper must carry a shrunk copy
    fig, ax = plt.subplots(figsize=(12, 12))
    ax.imshow(np.random.default_rng(2).random((900, 900, 3)))
    fig.savefig(out02 / "syn-noise.png", dpi=100)
    plt.close("all")
    write_json({"notebook": "02_route_overlap", "run_name": "syn", "source": "synthetic log", "python": "x",
                "parameters": {"model": None, "n_tokens": 24, "capacities": [2, 4, 16], "per_layer": True,
                               "window": 48, "route_log": None, "synthetic": True, "seed": 1},
                "run": run_info(None), **summary}, out02 / "syn.json")
    papers = tmp / "papers"
    from epqlab.papers import write_papers

    written = write_papers(res, papers, extra=[FIXTURES / "03_synth3.json"])
    return {"res": res, "papers": papers, "written": written, "model": model, "log": log, "params01": params01}


def test_papers_written_per_study(results):
    assert sorted(Path(p).name for p in results["written"]) == ["01_io_probe.md", "02_route_overlap.md",
                                                                "03_least_stale.md"]


def test_io_probe_paper_numbers_and_provenance(results):
    md = (results["papers"] / "01_io_probe.md").read_text()
    doc = json.loads((results["res"] / "01_io_probe" / "tiny.json").read_text())
    assert md.startswith("# 01 · Device I/O probe")
    t = _table(md, "request")
    head, rows = t[0], t[1:]
    assert len(rows) == len(doc["rows"]) == 4
    col = head.index("MB/s")
    for r, x in zip(rows, doc["rows"]):
        # MB/s worked out here from the raw byte count and wall time
        assert float(r[col]) == pytest.approx(round(x["total_bytes"] / x["wall_s"] / 1e6), abs=0.51)
    sha = hashlib.sha256(results["model"].read_bytes()).hexdigest()
    assert f"model SHA-256: `{sha}`" in md
    assert doc["run"]["machine"]["logical_cpus"] and f"{doc['run']['machine']['logical_cpus']} threads" in md
    # the reproduce command passes exactly the notebook's parameters, with their values
    cmd = next(l for l in md.splitlines() if l.startswith("papermill notebooks/01_io_probe.ipynb"))
    y = json.loads(shlex.split(cmd)[shlex.split(cmd).index("-y") + 1])
    assert y == {**results["params01"], "run_name": "tiny"}


def test_route_overlap_paper_matches_an_independent_count(results):
    md = (results["papers"] / "02_route_overlap.md").read_text()
    log = results["log"]
    # 16 slots per layer = every expert: only first touches miss, for every policy
    e = log.experts
    first = sum(len(np.unique(e[:, l, :])) for l in range(e.shape[1]))
    hit = 1 - first / e.size
    t = _table(md, "capacity")
    row = next(r for r in t[1:] if r[0] == "16")
    assert all(c == f"{100 * hit:.1f}" for c in row[1:]), (row, hit)
    assert f"16 slots per layer: best online policy lru, hit rate {hit:.1%}; Belady {hit:.1%} (100% of the bound)" in md


def test_figure_links_exist_and_are_small(results):
    papers = results["papers"]
    for name in ("01_io_probe.md", "02_route_overlap.md"):
        md = (papers / name).read_text()
        links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
        assert links, name
        for link in links:
            f = papers / link
            assert f.is_file() and 0 < f.stat().st_size < 200_000, (link, f.stat().st_size if f.exists() else None)
    src = results["res"] / "02_route_overlap" / "syn-noise.png"
    assert src.stat().st_size > 200_000  # the shrinking was needed
    assert "figures/02_route_overlap/syn-noise.png" in (papers / "02_route_overlap.md").read_text()
    n_png = len(list((results["res"] / "02_route_overlap").glob("syn-*.png")))
    assert len(re.findall(r"!\[", (papers / "02_route_overlap.md").read_text())) == n_png == 5


def test_cli_result_becomes_a_hand_run_section(results):
    md = (results["papers"] / "03_least_stale.md").read_text()
    doc = json.loads((FIXTURES / "03_synth3.json").read_text())
    assert "## Hand run `03_synth3.json`" in md
    assert "command reconstructed from the JSON's settings" in md
    assert "epqlab ablate eviction big/q8s.gguf --arenas 0.05,0.1,0.2 --policies lru,ls,ls_pos,lfu,static,fnu" in md
    # best online policy by steady-state hit rate at each point, worked out here from the rows
    for point in {r["point"] for r in doc["rows"]}:
        rows = [r for r in doc["rows"] if r["point"] == point]
        best = max(rows, key=lambda r: r["steady_hit_rate"])
        assert (f"- **{point}** ({int(best['slots'])} slots): best online policy {best['policy']} — steady-state "
                f"hit rate {best['steady_hit_rate']:.1%} vs Belady {best['belady_steady_hit_rate']:.1%} "
                f"({best['steady_hit_rate'] / best['belady_steady_hit_rate']:.0%} of the bound") in md
    # the reading is a list: one item per memory point, each on its own line
    assert sum(l.startswith("- **arena ") for l in md.splitlines()) == len({r["point"] for r in doc["rows"]})


def test_report_cli_errors(tmp_path, capsys):
    from epqlab.cli import main

    assert main(["report", str(tmp_path / "nope"), "--out", str(tmp_path / "p")]) == 1
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty"), "--out", str(tmp_path / "p")]) == 1
    assert "no results JSON" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": [{"x": 1}]}))
    assert main(["report", str(tmp_path / "empty"), "--out", str(tmp_path / "p"), "--extra", str(bad)]) == 1
    assert "not the results of a known study" in capsys.readouterr().err


def test_least_stale_paper_shows_the_routing_cap_table():
    from epqlab.papers.studies import least_stale

    doc = json.loads((FIXTURES / "03_synth3.json").read_text())
    # one point: 153 slots of 24 layers x 128 experts -> bound 153 / 3072 = 4.98 %
    doc["routing_cap"] = [{"point": "arena 5%", "slots": 153, "uniform_bound": 153 / 3072, "uniform_best_online": 0.0451,
                           "uniform_best_policy": "lfu", "uniform_belady": 0.1, "uniform_ratio": 0.451,
                           "model_best_online": 0.316, "model_best_policy": "fnu", "model_belady": 0.567,
                           "model_ratio": 0.316 / 0.567}]
    md = least_stale(doc)
    lines = md.splitlines()
    i = next(i for i, l in enumerate(lines) if "uniform bound %" in l)
    assert [c.strip() for c in lines[i + 2].strip("|").split("|")][:5] == ["arena 5%", "153", "5.0", "4.5", "10.0"]
    assert "no online policy can exceed slots / (L x E) = 5.0% there" in md
    assert "reaches 56% of Belady (31.6% vs 56.7%)" in md


def test_tournament_json_becomes_a_section_of_paper_03():
    """``epqlab ablate policies --json`` output is recognised as study 03 and rendered as a tournament: the gap share
    table holds (hit - LRU) / (Belady - LRU) of the JSON's own hit rates, worked out here by hand."""
    from epqlab.papers.studies import least_stale, study_of

    base = dict(point="arena 50%", arena_bytes=1 << 20, slots=100, addressing="slots", lru_hit_rate=0.40,
                belady_hit_rate=0.80, prefetch="off", layer_gap_share=[0.5], ssd_mb_per_token=1.0,
                decode_tok_s=float("nan"), live_equal=None)
    rows = [dict(base, policy="lru", kind="sim", hit_rate=0.40, gap_share=0.0, rank=2),
            dict(base, policy="heat", kind="sim", hit_rate=0.70, gap_share=0.75, rank=1),
            dict(base, policy="belady", kind="sim", hit_rate=0.80, gap_share=1.0, rank=None),
            dict(base, policy="heat", kind="live", hit_rate=0.70, gap_share=0.75, rank=1, live_equal=True,
                 layer_gap_share=None, decode_tok_s=5.0)]
    doc = {"model": "m.gguf", "n_tokens": 8, "decode_tokens": 7, "rows": rows}
    assert study_of(doc) == "03_least_stale"
    md = least_stale(doc)
    lines = md.splitlines()
    i = next(i for i, l in enumerate(lines) if l.startswith("| policy") and "arena 50%" in l)
    gaps = {c[0]: c[1] for c in ([x.strip() for x in l.strip("|").split("|")] for l in lines[i + 2:i + 5])}
    assert gaps == {"belady": "100.0", "heat": f"{100 * (0.70 - 0.40) / (0.80 - 0.40):.1f}", "lru": "0.0"}
    assert "best online policy heat" in md and "| True" in md


def test_seed_scale_json_becomes_a_section_of_paper_05(tmp_path):
    """bench/bench_seed_scale.py's JSON (here the committed transcription of the stand-in's table) is recognised as
    study 05 and rendered with each summary row joined to the paged run of the same level *and* prefetch."""
    from epqlab.papers import write_papers
    from epqlab.units import fmt_bytes

    src = Path(__file__).parents[1] / "bench" / "results" / "seed_scale_qwen3moe-35b-shape_2026-12-03.json"
    doc = json.loads(src.read_text())
    res = tmp_path / "results"
    res.mkdir()
    write_papers(res, tmp_path / "papers", extra=[src])
    md = (tmp_path / "papers" / "05_memory_levels.md").read_text()
    assert f"## Hand run `{src.name}`" in md and "transcribed from bench/README.md" in md
    rows = _table(md, "limit")[1:]
    assert len(rows) == len(doc["rows"])
    paged = {(p["level"], p["variant"]): p for p in doc["paged"]["rows"]}
    for cells, r in zip(rows, doc["rows"]):
        p = paged[(r["level"], r["prefetch"])]
        assert cells[:3] == [fmt_bytes(r["level"]), r["prefetch"], fmt_bytes(p["arena_bytes"])]
        assert cells[6].startswith(f"{p['decode_tok_s']:.2f} ({p['decode_tok_s_min']:.2f}-")
        assert float(cells[15]) == pytest.approx(r["roofline_ratio"])
    assert f"{doc['plain']['ms_per_token']:.0f} ms/token" in md


def test_every_results_file_the_docs_name_is_in_the_tree():
    """Each ``bench/results/*.json`` that bench/README.md names, and each "Hand run" file papers/05 renders, is a file
    of this tree that git tracks (not ignored): a clean clone must be able to regenerate papers/05 from them."""
    import subprocess

    root = Path(__file__).parents[1]
    named = set(re.findall(r"bench/results/([\w.\-]+\.json)", (root / "bench" / "README.md").read_text()))
    named |= set(re.findall(r"^## Hand run `([\w.\-]+\.json)`", (root / "papers" / "05_memory_levels.md").read_text(),
                            re.M))
    assert named, "bench/README.md names no results file: this test's pattern no longer matches the docs"
    for name in sorted(named):
        path = root / "bench" / "results" / name
        assert path.is_file(), f"{path} is named in the docs but absent"
        if (root / ".git").exists():
            ignored = subprocess.run(["git", "-C", str(root), "check-ignore", "-q", str(path)]).returncode == 0
            assert not ignored, f"{path} is git-ignored: a clean clone would not have it (.gitignore)"


def test_batch_lossy_bench_json_becomes_a_section_of_paper_07(tmp_path):
    """bench/bench_batching.py --lossy JSON (the committed 35B-shape run) is study 07 and renders one row per
    (setting, batch) with the ratios over its own exact batch 1, computed here from the rows."""
    from epqlab.papers import write_papers
    from epqlab.papers.studies import study_of

    src = Path(__file__).parents[1] / "bench" / "results" / "batch_lossy_qwen35-a3b_4GiB_2026-12-04.json"
    doc = json.loads(src.read_text())
    assert study_of(doc) == "07_lossy_knobs"
    res = tmp_path / "results"
    res.mkdir()
    write_papers(res, tmp_path / "papers", extra=[src])
    md = (tmp_path / "papers" / "07_lossy_knobs.md").read_text()
    rows = _table(md, "setting")[1:]
    assert len(rows) == len(doc["rows"])
    base = doc["rows"][0]
    for cells, r in zip(rows, doc["rows"]):
        assert cells[:2] == [r["setting"], str(r["batch"])]
        assert float(cells[3]) == pytest.approx(r["decode_tok_s"] / base["decode_tok_s"], rel=1e-2)
        assert float(cells[9]) == pytest.approx(r["union_per_layer"], rel=1e-2)


def test_mtp_bench_json_becomes_a_section_of_paper_06(tmp_path):
    """bench/bench_mtp.py's JSON (the committed 8 GiB run on the 35B shape) is study 06 and renders one row per
    (level, d, a) with tok/s over the same level's row without speculation and over plain, computed here."""
    from epqlab.papers import write_papers
    from epqlab.papers.studies import study_of

    src = Path(__file__).parents[1] / "bench" / "results" / "mtp_8gib.json"
    doc = json.loads(src.read_text())
    assert study_of(doc) == "06_batching"
    res = tmp_path / "results"
    res.mkdir()
    write_papers(res, tmp_path / "papers", extra=[src])
    md = (tmp_path / "papers" / "06_batching.md").read_text()
    assert "MTP speculative decoding with paged experts" in md
    rows = _table(md, "level")[1:]
    assert len(rows) == len(doc["rows"])
    base = {r["level"]: r["tok_s"] for r in doc["rows"] if not r["draft_max"]}
    for cells, r in zip(rows, doc["rows"]):
        assert cells[0] == r["level"] and float(cells[3]) == pytest.approx(r["tok_s"], rel=6e-3)
        assert float(cells[4]) == pytest.approx(r["tok_s"] / base[r["level"]], rel=6e-3)
        assert float(cells[5]) == pytest.approx(r["tok_s"] / doc["plain_tok_s"], rel=6e-3)
    assert "published acceptance a = 0.8" in md
