"""``epqlab serve --ram-budget auto --follow-memory`` in a memory cgroup while a hog in the same cgroup takes memory and
gives it back, with 4 clients sending requests all along: no process is OOM-killed, every request gets an answer
(200, or 503 with Retry-After while the arena is at its smallest and memory still short), the arena shrinks under
the hog and the server serves again once it is gone (docs/DESIGN.md §5 "Following memory")."""
from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import threading
import time

import pytest

from epqlab.memory.limits import cgroup_unavailable_reason, make_limit
from test_serve import _free_port, _wait_ready, httpx

pytestmark = pytest.mark.skipif(cgroup_unavailable_reason() is not None, reason="no writable memory cgroup here")
JOIN = 'echo $$ > "$0" || exit 97; exec "$@"'  # join the cgroup, then become the command (epqlab.memory.limits)
HOG = "import sys; b=bytearray({n}); [b.__setitem__(i,1) for i in range(0,len(b),4096)]; print('up',flush=True); sys.stdin.read()"


def test_serve_follows_memory_under_a_hog(default_model_path):
    cg = make_limit(1536 * 2**20, "cgroup")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    srv = subprocess.Popen(["/bin/sh", "-c", JOIN, str(cg.procs), sys.executable, "-m", "epqlab", "serve",
                            str(default_model_path), "--port", str(port), "--threads", "1", "--n-ctx", "256",
                            "--max-batch", "2", "--ram-budget", "auto", "--follow-memory", "--log-level", "warning"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    hog = None
    answers: list[tuple[float, int, str | None]] = []
    stop = threading.Event()

    def client(i):
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                r = c.post(url + "/v1/completions", json={"prompt": f"Client {i} asks about caches", "max_tokens": 8,
                                                          "temperature": 0})
                answers.append((time.monotonic(), r.status_code, r.headers.get("retry-after")))
                if r.status_code == 503:
                    time.sleep(0.2)

    def scrape(name):
        for line in httpx.get(url + "/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])

    try:
        _wait_ready(url, srv)
        full = scrape("epqlab_arena_bytes")
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            futs = [ex.submit(client, i) for i in range(4)]
            time.sleep(1.5)
            hog = subprocess.Popen(["/bin/sh", "-c", JOIN, str(cg.procs), sys.executable, "-c",
                                    HOG.format(n=1000 * 2**20)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert hog.stdout.readline().strip() == "up"
            t_hog = time.monotonic()
            deadline = time.monotonic() + 30
            while not any(t > t_hog and code == 503 for t, code, _ in answers) and time.monotonic() < deadline:
                time.sleep(0.1)
            shrunk = scrape("epqlab_arena_bytes")
            hog.stdin.close()
            hog.wait(30)
            t_free = time.monotonic()
            deadline = time.monotonic() + 30
            while not any(t > t_free + 0.5 and code == 200 for t, code, _ in answers) and time.monotonic() < deadline:
                time.sleep(0.1)
            stop.set()
            for f in futs:
                f.result()  # a client that lost a request (a connection error) raises here
        codes = [code for _, code, _ in answers]
        assert set(codes) <= {200, 503}, codes
        assert any(t > t_hog and code == 503 for t, code, _ in answers)  # at the floor under the hog: refused
        assert all(ra == "5" for _, code, ra in answers if code == 503)
        assert any(t > t_free + 0.5 and code == 200 for t, code, _ in answers)  # served again afterwards
        assert shrunk < full
        assert scrape("epqlab_arena_resizes_total") >= 1
        assert srv.poll() is None  # the server is alive
        assert not cg.readings()["oom_kills"]
    finally:
        stop.set()
        if hog is not None and hog.poll() is None:
            hog.kill()
        srv.terminate()
        try:
            srv.wait(20)
        except subprocess.TimeoutExpired:
            srv.kill()
        cg.remove()
