"""Model-file checks on content, not metadata (epqlab.engine.file_watch, docs/DESIGN.md §4): chmod, a hard link or a
copy with identical bytes renamed over the file never stop a Session; a write into the file, or other bytes renamed
over it, do; and a server whose model changed answers every request with an OpenAI JSON error (503), /health too."""
from __future__ import annotations

import os
import shutil

import pytest

import epqlab


def _copy(src, tmp_path):
    p = tmp_path / "m.gguf"
    shutil.copy(src, p)
    return p


def _session(p):
    return epqlab.Session(p, n_threads=1, n_ctx=256, arena_bytes=epqlab.Pager.min_arena_bytes(epqlab.inspect(p)))


def test_metadata_changes_and_identical_replacement_pass(mini_gguf, tmp_path):
    p = _copy(mini_gguf, tmp_path)
    with _session(p) as s:
        want = s.generate([1, 2, 3], 4).tokens
        os.chmod(p, 0o400)                      # ctime only
        os.link(p, tmp_path / "hard-link.gguf")  # ctime and nlink only
        assert s.generate([1, 2, 3], 4).tokens == want
        assert s.decoder.files.content_checks == 0  # stat data decided: no file was read
        twin = tmp_path / "twin.gguf"
        shutil.copy(p, twin)
        os.replace(twin, p)                     # another inode, the same bytes (cp + mv, rsync)
        assert s.generate([1, 2, 3], 4).tokens == want
        assert s.generate([1, 2, 3], 4).tokens == want
        assert s.decoder.files.content_checks == 1  # compared once, then known


@pytest.mark.parametrize("how", ["replaced-other-bytes", "touched-in-place", "deleted"])
def test_real_changes_are_refused_and_stay_refused(mini_gguf, tmp_path, how):
    p = _copy(mini_gguf, tmp_path)
    with _session(p) as s:
        s.generate([1, 2, 3], 2)
        if how == "replaced-other-bytes":
            other = tmp_path / "other.gguf"
            shutil.copy(p, other)
            with open(other, "r+b") as f:  # same size, one byte of the last expert's weights changed
                f.seek(-1, os.SEEK_END)
                b = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([b[0] ^ 1]))
            os.replace(other, p)
            msg = "replaced by a file with other bytes"
        elif how == "touched-in-place":  # the Session's own inode: a changed mtime may be a rewrite
            st = p.stat()
            os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
            msg = "written in place"
        else:
            p.unlink()
            msg = "it is gone"
        with pytest.raises(epqlab.ModelChangedError, match=msg):
            s.generate([1, 2, 3], 2)
        if how == "deleted":
            shutil.copy(mini_gguf, p)  # the same bytes back: still refused, the Session is done
        with pytest.raises(epqlab.ModelChangedError, match=msg):
            s.generate([1, 2, 3], 2)


def test_server_answers_503_json_once_the_model_changed(mini_gguf, tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("sse_starlette")
    from fastapi.testclient import TestClient

    from epqlab.server import create_app

    p = _copy(mini_gguf, tmp_path)
    with _session(p) as s, TestClient(create_app(s)) as c:
        assert c.get("/health").json() == {"status": "ok"}
        body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
        assert c.post("/v1/completions", json=body).status_code == 200
        os.chmod(p, 0o400)
        assert c.post("/v1/completions", json=body).status_code == 200
        with open(p, "r+b") as f:  # an in-place write: same bytes, but the mtime moves
            f.seek(0)
            f.write(f.read(4))
        os.utime(p, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns + 10**9))
        for method, path, kw in [("post", "/v1/completions", {"json": body}),
                                 ("post", "/v1/completions", {"json": {**body, "stream": True}}),
                                 ("post", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "Hi"}]}}),
                                 ("get", "/v1/models", {}), ("post", "/tokenize", {"json": {"input": "Hi"}})]:
            r = getattr(c, method)(path, **kw)
            assert r.status_code == 503 and r.headers["content-type"] == "application/json", (path, r.text)
            err = r.json()["error"]
            assert err["type"] == "server_error" and "changed on disk" in err["message"] and str(p) in err["message"]
            # an HTTP client has no Session to close: the fix is said in the server's terms
            assert "Session" not in err["message"] and "restart the server" in err["message"], err["message"]
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "error"
        assert "restart the server" in h.json()["error"]["message"] and str(p) not in h.text  # no key: no path
