"""MTP speculative decoding with paged experts (``Session(speculative="mtp")``, epqlab/engine/speculative.py) on a
tiny qwen35moe with one MTP block (hybrid memory: Gated-DeltaNet state + attention KV, so a rejected draft rolls the
recurrent state back through llama.cpp's snapshots).

References are worked out independently of the speculative loop: plain llama.cpp (``pager=False``) for
bit-identity, a non-speculative greedy run for the tokens and logits, and the acceptance rule counted by hand from
the reference tokens.
"""
from __future__ import annotations

import numpy as np
import pytest

import epqlab
from epqlab.engine.speculative import MtpSpeculator
from epqlab.models.archs import write_tiny

N = 24
PROMPT = list(range(3, 40))
ARENA = "120KiB"  # smallest that works is 108 KiB: the trunk's and the MTP block's experts compete for ~1/3 of them


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("mtp") / "qwen35moe.gguf", "qwen35moe")


@pytest.fixture(scope="module")
def reference(model):
    """Non-speculative greedy tokens of PROMPT and the logits of every decode step (plain llama.cpp)."""
    with epqlab.Session(model, pager=False, n_threads=1, n_ctx=256) as s:
        toks, steps = [], []
        logits, pos = s.logits(PROMPT)[-1], len(PROMPT)
        d = s.decoder
        with d.lock:
            epoch, _ = d.begin()
            logits = d.prefill(PROMPT, epoch)
            for _ in range(N):
                t = int(np.argmax(logits))
                if d.is_eog(t):
                    break
                toks.append(t)
                logits = d.step(t, pos, epoch)
                steps.append(logits.copy())
                pos += 1
    assert len(toks) >= 10, "the reference must generate enough tokens to draft against"
    return toks, steps


class Recorder:
    """Wraps a native Engine: records the logits of every target decode and every MTP pass."""

    def __init__(self, engine):
        self._e, self.target, self.mtp = engine, [], []
        self.rows, self.draft_inputs = [], []  # hidden rows of each target decode; the h of each draft pass

    def __getattr__(self, k):
        return getattr(self._e, k)

    def decode(self, *a, **kw):
        out = self._e.decode(*a, **kw)
        self.target.append(np.array(out))
        return out

    def nextn_rows(self, n):
        out = self._e.nextn_rows(n)
        self.rows.append(np.array(out))
        return out

    def mtp_decode(self, *a, **kw):
        if np.asarray(a[3]).any():  # a draft pass (a catch-up pass outputs nothing)
            self.draft_inputs.append((int(a[1][0]), np.array(a[2][0])))
        lg, h = self._e.mtp_decode(*a, **kw)
        self.mtp.append((np.array(lg), np.array(h)))
        return lg, h


def _record(s) -> Recorder:
    rec = Recorder(s.decoder.engine)
    s.decoder.engine = rec
    s.decoder.mtp.engine = rec
    return rec


def _drafts_from(ref_toks, pattern):
    """A replacement for MtpSpeculator._draft: runs the real MTP passes, then proposes the reference's next tokens,
    each right or wrong as ``pattern(verify_index, i)`` says (wrong = the right token + 1)."""
    orig = MtpSpeculator._draft
    calls = []

    def fake(self, last, pos, n_left):
        real = orig(self, last, pos, n_left)
        j = len(calls)
        calls.append(pos)
        out = []
        for i in range(len(real)):
            right = ref_toks[pos + i + 1 - len(PROMPT)]
            out.append(right if pattern(j, i) else (right + 1) % 355)
        return out
    return fake, calls


def test_refusals(model, default_model_path):
    with pytest.raises(ValueError, match="nextn_predict_layers"):
        epqlab.Session(default_model_path, speculative="mtp", n_ctx=256)
    with pytest.raises(ValueError, match="n_ubatch >= 5"):  # llama.cpp would abort in split_equal
        epqlab.Session(model, speculative="mtp", n_ubatch=4, n_ctx=256)
    bad = [dict(speculative="eagle"), dict(speculative="mtp", draft_max=0), dict(speculative="mtp", draft_max=9),
           dict(speculative="mtp", draft_max=True), dict(speculative="mtp", draft_p_min=1.5),
           dict(draft_max=2), dict(speculative="mtp", n_seq_max=2), dict(speculative="mtp", prefetch="lookahead"),
           dict(speculative="mtp", expert_budget=2), dict(speculative="mtp", route_log="/tmp/x.npz")]
    for kw in bad:
        with pytest.raises(ValueError):
            epqlab.Session(model, n_ctx=256, **kw)
    with epqlab.Session(model, n_ctx=256, n_threads=1) as s:
        with pytest.raises(ValueError, match="draft_accept"):
            s.stream(PROMPT, 4, forced=[5, 6, 7], draft_accept=0.5)
    with epqlab.Session(model, n_ctx=256, n_threads=1, speculative="mtp") as s:
        for seed in (-1, 1.5, "x"):
            with pytest.raises(ValueError, match="draft_seed"):
                s.stream(PROMPT, 4, forced=[5, 6, 7], draft_accept=0.5, draft_seed=seed)
        with pytest.raises(ValueError, match="draft_seed"):
            s.stream(PROMPT, 4, draft_seed=1)
        g = s.generate(PROMPT, 0)  # nothing decoded: the counters are there, zero
        assert g.stats["spec_drafted"] == 0 and g.stats["speculative"] == "mtp"


@pytest.mark.parametrize("policy", ["lru", "lfu", "ls"])
def test_paged_speculation_is_plain_speculation_bit_for_bit(model, reference, policy):
    """Every verify pass's logits and every MTP pass's logits and hidden rows of a paged run at a small arena equal
    plain llama.cpp's (pager=False) running the same speculation, and the tokens equal non-speculative greedy."""
    recs, outs = [], []
    for kw in (dict(pager=False), dict(arena_bytes=ARENA, policy=policy)):
        with epqlab.Session(model, n_threads=1, n_ctx=256, speculative="mtp", draft_max=3, **kw) as s:
            rec = _record(s)
            g = s.generate(PROMPT, N)
            recs.append(rec)
            outs.append(g)
            if s.pager:
                assert 4 in s.layout.moe_layers and s.mtp_blocks == [4]  # the MTP block is paged like a layer
                assert g.stats["spec_mtp_union"] > 0 and g.stats["misses"] > 0
    plain, paged = recs
    assert outs[0].tokens == outs[1].tokens == reference[0][:len(outs[0].tokens)]
    assert len(plain.target) == len(paged.target) > 3 and len(plain.mtp) == len(paged.mtp) > 3
    for a, b in zip(plain.target, paged.target):
        assert a.shape == b.shape and np.array_equal(a, b)
    for (la, ha), (lb, hb) in zip(plain.mtp, paged.mtp):
        assert np.array_equal(la, lb) and np.array_equal(ha, hb)
    assert max(x.shape[0] for x in paged.target[1:]) == 4  # verify passes of 1 + 3 tokens ran


@pytest.mark.parametrize("pager", [False, True])
def test_rejected_drafts_give_the_greedy_tokens_and_logits(model, reference, monkeypatch, pager):
    """Every draft wrong: each verify pass rolls back 3 tokens (the recurrent state through its snapshots), and
    the tokens are exactly non-speculative greedy's; each accepted row's logits match the non-speculative step's
    (a verify pass computes 4 rows at once: llama.cpp's Gated-DeltaNet then takes its chunked path, and the
    first verify pass, before any rollback, differs from the single-token step by ~3e-4)."""
    ref_toks, ref_steps = reference
    fake, calls = _drafts_from(ref_toks, lambda j, i: False)
    monkeypatch.setattr(MtpSpeculator, "_draft", fake)
    kw = dict(arena_bytes=ARENA) if pager else dict(pager=False)
    with epqlab.Session(model, n_threads=1, n_ctx=256, speculative="mtp", draft_max=3, **kw) as s:
        rec = _record(s)
        g = s.generate(PROMPT, len(ref_toks))
    assert g.tokens == ref_toks
    st = g.stats
    n = len(ref_toks)  # one token per target pass; the draft is cut to the tokens left after its verify row
    assert st["spec_accepted"] == 0 and st["spec_drafted"] == sum(min(3, n - e - 1) for e in range(1, n)) > 0
    verify = [x for x in rec.target[1:]]  # after the prompt
    for j, rows in enumerate(verify):
        np.testing.assert_allclose(rows[0], ref_steps[j], rtol=0, atol=3e-3)
        assert int(np.argmax(rows[0])) == (ref_toks[j + 1] if j + 1 < len(ref_toks) else int(np.argmax(ref_steps[j])))


def test_accept_counters_against_a_hand_count(model, reference, monkeypatch):
    """Drafts right, right, wrong (draft_max 3): each verify pass accepts 2 and emits 3 tokens; the counters equal a
    hand count from the reference, and the tokens equal greedy's."""
    ref_toks, _ = reference
    fake, calls = _drafts_from(ref_toks, lambda j, i: i < 2)
    monkeypatch.setattr(MtpSpeculator, "_draft", fake)
    n = len(ref_toks)
    with epqlab.Session(model, n_threads=1, n_ctx=256, speculative="mtp", draft_max=3, arena_bytes=ARENA) as s:
        rec = _record(s)
        g = s.generate(PROMPT, n)
    assert g.tokens == ref_toks
    # each draft's first pass takes the target's hidden row of the position before it: the prompt's last row, then
    # row m (the last accepted token) of the verify pass before it, not the rejected tail's last row
    firsts = [next(h for p, h in rec.draft_inputs if p == c) for c in calls if any(p == c for p, _ in rec.draft_inputs)]
    assert np.array_equal(firsts[0], rec.rows[0][-1])
    for j, h in enumerate(firsts[1:]):
        k = rec.rows[j + 1].shape[0] - 1
        assert np.array_equal(h, rec.rows[j + 1][min(k, 2)])
    # by hand: the first token comes from the prompt; then while tokens remain, a draft of min(3, left - 1) tokens
    emitted, drafted, accepted, verifies, plain, per_pos = 1, 0, 0, 0, 0, [0, 0, 0]
    while emitted < n:
        k = min(3, n - emitted - 1)
        m = min(k, 2)
        if k:
            verifies, drafted, accepted = verifies + 1, drafted + k, accepted + m
            for i in range(m):
                per_pos[i] += 1
        else:
            plain += 1
        emitted += m + 1
    st = g.stats
    assert (st["spec_drafted"], st["spec_accepted"], st["spec_verify_steps"], st["spec_plain_steps"]) == \
        (drafted, accepted, verifies, plain)
    assert st["spec_accepted_per_pos"] == per_pos
    assert st["spec_acceptance"] == pytest.approx(accepted / drafted)
    assert len(calls) == verifies + plain


def test_study_mode_acceptance_is_the_seeded_draw(model, reference):
    """draft_accept=a: the forced tokens come out, and the accepted count equals a hand replay of the seeded draws
    (each draft right with probability a, accepted while right)."""
    ref_toks, _ = reference
    forced = ref_toks[:16]
    a, seed, d = 0.6, 7, 3
    with epqlab.Session(model, n_threads=1, n_ctx=256, speculative="mtp", draft_max=d, arena_bytes=ARENA) as s:
        st = s.stream(PROMPT, len(forced), forced=forced, draft_accept=a, draft_seed=seed)
        list(st)
    assert st.result.tokens == forced
    rng = np.random.default_rng(seed)
    emitted, drafted, accepted = 1, 0, 0
    while emitted < len(forced):
        k = min(d, len(forced) - emitted - 1)
        right = [rng.random() < a for _ in range(k)]
        m = next((i for i, r in enumerate(right) if not r), k)
        drafted, accepted, emitted = drafted + k, accepted + m, emitted + m + 1
    assert (st.stats["spec_drafted"], st.stats["spec_accepted"]) == (drafted, accepted)


def test_chat_completion_and_cli(model, capsys):
    with epqlab.Session(model, n_threads=1, n_ctx=256, pager=False) as s:
        want = s.create_completion("The pager reads", max_tokens=8, temperature=0)["choices"][0]["text"]
    with epqlab.Session(model, n_threads=1, n_ctx=256, speculative="mtp", arena_bytes=ARENA) as s:
        got = s.create_completion("The pager reads", max_tokens=8, temperature=0)
        assert got["choices"][0]["text"] == want
        chunks = list(s.create_completion("The pager reads", max_tokens=8, temperature=0, stream=True))
        assert "".join(c["choices"][0]["text"] for c in chunks) == want
    from epqlab.cli import main
    assert main(["run", str(model), "-p", "The pager reads", "-n", "8", "--n-ctx", "256", "--threads", "1",
                 "--spec-type", "draft-mtp", "--spec-draft-n-max", "2"]) == 0
    out = capsys.readouterr().out
    assert "speculative (MTP)" in out and "drafted tokens accepted" in out
    assert main(["run", str(model), "-n", "2", "--spec-draft-n-max", "2"]) != 0
    assert "go with --spec-type draft-mtp" in capsys.readouterr().err


def test_mtp_experts_inside_a_cgroup_of_the_budget(tmp_path):
    """A qwen35moe whose MTP block pages from the same arena, under a memory cgroup of ram_budget + 16 MiB: the
    budget is the smallest that works plus 8 MiB (an arena of about half the routed experts), and a speculative run
    of held-out text at a = 0.8 decodes, reads the MTP block's experts, and stays under the limit."""
    import json
    import re
    import sys

    from epqlab.memory import limits
    from epqlab.models import synthesize

    if limits.cgroup_unavailable_reason() is not None:
        pytest.skip(f"no writable memory cgroup here: {limits.cgroup_unavailable_reason()}")
    m = tmp_path / "q35s.gguf"
    synthesize(m, "qwen35-a3b", progress=False, n_layer=4, n_embd=512, n_head=4, n_head_kv=2, head_dim=128,
               n_expert=128, n_expert_used=4, n_ff_exp=256, n_vocab=0)
    lay = epqlab.inspect(m)
    all_experts = lay.routed_expert_bytes + lay.mtp_expert_bytes

    def child(budget, tag, limit=None):
        spec = {"model": str(m), "ram_budget": budget, "n_predict": 16, "prompt_tokens": 16, "accept": 0.8,
                "draft_max": 3, "seed": 1, "session_kw": {"n_threads": 1, "n_ctx": 256}}
        (tmp_path / f"{tag}.json").write_text(json.dumps(spec))
        argv = [sys.executable, "-m", "epqlab.studies.speculative_child", str(tmp_path / f"{tag}.json"),
                str(tmp_path / f"{tag}.out")]
        lim = limits.run_limited(argv, limit or 8 * 2**30, timeout_s=600)
        return lim, json.loads((tmp_path / f"{tag}.out").read_text())

    _, probe = child(64 * 2**20, "probe")  # refused: the message names the smallest budget that works
    need = int(re.search(r"smallest budget that works is (\d+) bytes", probe["reason"]).group(1))
    budget = need + 8 * 2**20
    lim, out = child(budget, "run", budget + 16 * 2**20)
    assert not lim.killed and out["status"] == "PASS", (lim.reason, out.get("reason"))
    row = out["row"]
    assert out["arena_bytes"] < all_experts  # the experts compete for the arena
    assert row["mtp_union"] > 0 and row["ssd_mb_per_token"] > 0 and row["drafted"] > 0
    assert lim.cgroup_peak is not None and lim.cgroup_peak <= budget + 16 * 2**20


def test_near_the_context_end_speculation_stops_where_plain_decoding_does(model):
    """A prompt 6 tokens short of n_ctx: drafts are cut so no verify pass crosses the context, and the generation
    ends with the same error, after the same tokens, as non-speculative decoding."""
    prompt = [3 + (i * 7) % 300 for i in range(250)]
    outs = []
    for kw in (dict(), dict(speculative="mtp", draft_max=3)):
        with epqlab.Session(model, n_threads=1, n_ctx=256, pager=False, **kw) as s:
            st = s.stream(prompt, 20)
            with pytest.raises(ValueError, match="exceed the context"):
                for _ in st:
                    pass
            outs.append(list(st.tokens))
    assert outs[0] == outs[1] and len(outs[0]) == 256 - 250 + 1  # the last one sampled from position 255
