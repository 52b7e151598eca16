"""The Sampler's OpenAI / llama-cpp-python options on hand-made logits rows (no model), each against a NumPy
computation of what llama.cpp's sampler is documented to do: logit bias, frequency / presence penalties,
typical sampling (arXiv:2202.00666), mirostat v2's first step (arXiv:2007.14966), and the log-probabilities."""
from __future__ import annotations

import numpy as np
import pytest

from epqlab.engine.sampling import Sampler

ROW = np.log(np.array([0.05, 0.6, 0.2, 0.1, 0.05], np.float32))  # probabilities of 5 tokens


def _draws(seeds=range(40), **kw):
    out = set()
    for sd in seeds:
        s = Sampler(len(ROW), seed=sd, top_k=0, top_p=1.0, min_p=0.0, temperature=1.0, **kw)
        out.add(s.sample(ROW))
        s.free()
    return out


def test_bias_and_penalties_greedy():
    s = Sampler(len(ROW), temperature=0, logit_bias={"3": 100})
    assert s.sample(ROW) == 3  # +100 makes token 3 the argmax
    s = Sampler(len(ROW), temperature=0, logit_bias={1: -100})
    assert s.sample(ROW) == 2
    # token 1 seen twice in the context: logit - 2 * f - p; token 2 once: - f - p
    f, p = 0.5, 1.0
    adj = ROW.astype(np.float64).copy()
    adj[1] -= 2 * f + p
    adj[2] -= f + p
    s = Sampler(len(ROW), temperature=0, frequency_penalty=f, presence_penalty=p)
    s.accept([1, 1, 2])
    assert s.sample(ROW) == int(np.argmax(adj)) == 3  # 1: -0.51 - 2.0, 2: -1.61 - 1.5, 3: -2.30; either penalty alone leaves 1
    with pytest.raises(ValueError, match="logit_bias key"):
        Sampler(len(ROW), logit_bias={"x": 1})
    with pytest.raises(ValueError, match="frequency_penalty"):
        Sampler(len(ROW), frequency_penalty=3)


def test_typical_keeps_the_typical_set():
    p = np.exp(ROW.astype(np.float64))
    p /= p.sum()
    h = -(p * np.log(p)).sum()
    order = np.argsort(np.abs(-np.log(p) - h), kind="stable")  # closest to the entropy first
    tau = 0.5
    n = int(np.searchsorted(np.cumsum(p[order]), tau) + 1)  # smallest prefix whose mass reaches tau
    typical = set(order[:n].tolist())
    assert typical != set(range(len(ROW)))
    got = _draws(typical_p=tau)
    assert got <= typical and len(got) >= 1
    assert _draws() - typical  # without it, tokens outside the set are drawn


def test_mirostat_v2_first_step_truncates_by_surprise():
    # mu starts at 2 * tau; tokens whose surprise -log2 p exceeds it are dropped: tau 0.5 keeps p >= 0.5
    assert _draws(mirostat_mode=2, mirostat_tau=0.5, mirostat_eta=0.1) == {1}
    assert len(_draws(mirostat_mode=2, mirostat_tau=5.0, mirostat_eta=0.1)) > 1


def test_logprobs_records():
    s = Sampler(len(ROW), temperature=0, n_logprobs=2)
    tok = s.sample(ROW)
    lp = ROW.astype(np.float64) - np.log(np.exp(ROW.astype(np.float64)).sum())
    assert s.logprobs[0][0] == tok == 1 and s.logprobs[0][1] == pytest.approx(lp[1])
    assert [t for t, _ in s.logprobs[0][2]] == [1, 2]  # the two most likely, most likely first
