"""The prompt cache on disk (epqlab/engine/prompt_disk_cache.py, state_file.py) and Session.save_state/load_state:
a restarted server starts a prompt that extends a saved 1,000-token sequence from its state and answers exactly what a
fresh server without any cache answers (tokens and logprobs, bit for bit); a truncated or foreign file is refused,
removed and logged and the request is still answered; a full cache evicts the least recently used file; a Session
resumes from a saved state as it resumes from its own context."""
from __future__ import annotations

import os

import pytest

import epqlab
from epqlab.data import heldout_texts
from epqlab.engine import state_file
from epqlab.engine.state_file import StateFileError

pytest.importorskip("fastapi")
pytest.importorskip("sse_starlette")
KW = dict(n_threads=1, n_ctx=1536, n_ubatch=128, n_batch=512)


@pytest.fixture(scope="module")
def prompts(default_model_path):
    """A held-out text's first 1,000 tokens, and the next turn: those tokens plus a question."""
    with epqlab.Session(default_model_path, pager=False, **KW) as s:
        ids = s.tokenize(next(iter(heldout_texts().values())))
    assert len(ids) >= 1000
    first = ids[:1000]
    return first, first + ids[1000:1040]


def _complete(c, tokens, n=6):
    r = c.post("/v1/completions", json={"prompt": tokens, "max_tokens": n, "temperature": 0, "logprobs": 1})
    assert r.status_code == 200, r.text
    j = r.json()
    return j["choices"][0]["text"], j["choices"][0]["logprobs"]["token_logprobs"], j["epqlab"]["n_prompt_reused"]


def _app(path, cache_dir, mode="exact", size=4 << 30):
    from fastapi.testclient import TestClient

    from epqlab.server import create_app

    s = epqlab.Session(path, **KW)
    return s, TestClient(create_app(s, prompt_cache=mode, prompt_cache_dir=cache_dir, prompt_cache_size=size))


def _files(d):
    return sorted(p for p in d.rglob("*.epqs"))


def test_restarted_server_reuses_a_saved_prefix_exactly(default_model_path, prompts, tmp_path, caplog):
    first, second = prompts
    s, c = _app(default_model_path, tmp_path)
    with s, c:
        _complete(c, first, n=4)  # the first turn: its state is saved when it ends
    files = _files(tmp_path)
    assert len(files) == 1 and files[0].stat().st_size > 0

    # a restart: a new Session and app on the same directory
    s, c = _app(default_model_path, tmp_path)
    with s, c:
        text, lp, reused = _complete(c, second)
        m = c.get("/metrics").text
    assert reused == 896  # the saved prompt's whole 128-token ubatches inside the shared 1,000 tokens (7 x 128)
    assert "epqlab_prompt_cache_disk_hits_total 1.0" in m

    # the reference: a fresh server with no cache at all
    s, c = _app(default_model_path, None, mode="off")
    with s, c:
        ref_text, ref_lp, ref_reused = _complete(c, second)
    assert ref_reused == 0
    assert text == ref_text and lp == ref_lp  # bit for bit: the exact rule

    # a truncated file is refused, removed and logged; the request is still answered, uncached
    files = _files(tmp_path)
    assert len(files) == 2  # the restarted server saved its own sequence too
    for f in files:
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size - 100)
    s, c = _app(default_model_path, tmp_path)
    with s, c:
        with caplog.at_level("WARNING", logger="epqlab.prompt_cache"):
            text2, lp2, reused2 = _complete(c, second)
    assert caplog.text.count("refused and removed") == caplog.text.count("truncated") == 2
    for f in _files(tmp_path):  # what is there now is the new server's own, whole state
        state_file.read_state(state_file.read_header(f))
    assert reused2 == 0 and (text2, lp2) == (ref_text, ref_lp)


def test_foreign_file_and_lru_eviction(default_model_path, prompts, tmp_path):
    from epqlab.engine.prompt_disk_cache import PromptDiskCache

    first, _ = prompts
    d = PromptDiskCache(tmp_path, 10_000, "a" * 64)
    for i in range(3):  # 4,000-byte states: the third write pushes the oldest out
        d.save([i, 1, 2], [3], bytes([i]) * 4000)
        d.flush()
        os.utime(d.key([i, 1, 2]), ns=(10**18 + i, 10**18 + i))  # a clear order of use
    assert [sorted(e.tokens) for e in d.entries.values()] == [[1, 1, 2], [1, 2, 2]]
    assert d.disk_bytes() <= 10_000 and len(_files(tmp_path)) == 2
    # a file of another identity in this identity's directory is refused and removed at start
    other = d.dir / ("f" * 40 + ".epqs")
    state_file.write(other, "b" * 64, [5], [], b"xyz")
    d2 = PromptDiskCache(tmp_path, 10_000, "a" * 64)
    assert not other.exists() and d2.refused == 1 and len(d2.entries) == 2
    with pytest.raises(ValueError, match="cannot write there"):
        PromptDiskCache("/proc/epqlab-no", 1000, "a" * 64)


def test_session_save_and_load_state(default_model_path, prompts, tmp_path):
    first, second = prompts
    path = tmp_path / "chat.epqs"
    with epqlab.Session(default_model_path, **KW) as a:
        a.generate(first, n_predict=2)
        size = a.save_state(path)
        want = a.generate(second, n_predict=6, reuse_kv=True)  # the same Session continuing from its own context
    assert size == path.stat().st_size and want.stats["n_prompt_reused"] > 0
    with epqlab.Session(default_model_path, **KW) as b:
        held = b.load_state(path)
        got = b.generate(second, n_predict=6, reuse_kv=True)
    assert held[:1000] == first and got.stats["n_prompt_reused"] == want.stats["n_prompt_reused"]
    assert got.tokens == want.tokens
    with epqlab.Session(default_model_path, **{**KW, "n_ctx": 1024}) as other:
        with pytest.raises(StateFileError, match="another model or context"):
            other.load_state(path)
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size - 1)
    with epqlab.Session(default_model_path, **KW) as b:
        with pytest.raises(StateFileError, match="truncated"):
            b.load_state(path)
