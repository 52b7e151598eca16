"""Session decoding features checked against references computed here: ``stream(stop=...)`` against the
text of the same greedy run without a stop, and temperature sampling (llama.cpp's own sampler chain, reached
through llama-cpp-python's ctypes API) against inverse-CDF sampling of a float64 softmax at the uniforms of
std::mt19937 seeded with the seed, computed here with NumPy's MT19937. Plain llama.cpp (``pager=False``) on the default model: paging does
not change logits (test_session). Perplexity against an independent log-softmax: tests/test_ppl.py."""
from __future__ import annotations

import numpy as np
import pytest

import epqlab

THREADS = 1


@pytest.fixture(scope="module")
def session(default_model_path):
    with epqlab.Session(default_model_path, pager=False, n_threads=THREADS, n_ctx=256) as s:
        yield s


def test_stream_stop_cuts_before_the_stop_string(session):
    s = session
    prompt = "The three primary colours are red, green and"
    full = s.generate(prompt, 24)
    assert len(full.tokens) == 24, "the reference run must not end early"
    text = full.text
    # a stop string that first appears after some generated text: its second word
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[2]
    cut = text.find(stop)
    assert cut > 0
    pieces = list(s.stream(prompt, 24, stop=[stop]))
    assert "".join(pieces) == text[:cut]
    assert all(stop not in p for p in pieces)
    g = s.generate(prompt, 24, stop=["never appears \x00", stop])
    assert g.text == text[:cut]
    assert len(g.tokens) < 24 and g.tokens == full.tokens[:len(g.tokens)]  # stopped early, same greedy tokens
    # a stop string that never appears changes nothing
    assert s.generate(prompt, 24, stop=["\x00\x01"]).text == text


def cdf_positions(s, prompt_tokens: list[int], tokens: list[int], temperature: float):
    """For each generated token t_i: the interval [F(t_i - 1), F(t_i)) of the CDF of softmax(logits / T)
    (float64, vocabulary order) that a uniform draw must fall in to pick t_i (inverse-CDF sampling over the
    unsorted candidates, what llama.cpp's ``dist`` sampler does). Logits come from a fresh teacher-forced decode
    of prompt + tokens so far."""
    out = []
    for i, t in enumerate(tokens):
        z = s.logits(prompt_tokens + tokens[:i])[-1].astype(np.float64) / temperature
        cdf = np.cumsum(np.exp(z - z.max()))
        cdf /= cdf[-1]
        out.append((cdf[t - 1] if t else 0.0, cdf[t]))
    return out


def mt19937_uniforms(seed: int, n: int) -> np.ndarray:
    """The first n draws of ``std::uniform_real_distribution<double>(0, 1)`` on ``std::mt19937(seed)``: with a
    32-bit engine, libstdc++'s ``generate_canonical<double, 53>`` takes two outputs, (r0 + r1 * 2^32) / 2^64.
    ``std::mt19937(seed)`` is MT19937's init_genrand, NumPy's legacy seeding."""
    bg = np.random.MT19937(0)
    bg._legacy_seeding(seed)
    r = bg.random_raw(2 * n).astype(np.float64).reshape(n, 2)
    return (r[:, 0] + r[:, 1] * 2.0**32) / 2.0**64


def test_temperature_sampling_is_seeded_and_follows_softmax(session):
    """Sampling = inverse CDF of softmax(logits / T) at the uniforms of ``std::mt19937(seed)`` (llama.cpp's
    ``dist`` sampler; top-k/top-p/min-p off, as :meth:`Session.generate` defaults them). The first token's
    logits are the prefill's, exactly those of :meth:`Session.logits`; later ones come from single-token decodes,
    whose logits differ from a teacher-forced batch decode in the last bits (llama.cpp's kernels differ by batch
    size), which moves CDF positions by up to ~2e-3 on this model: later draws get a 0.01 tolerance."""
    s = session
    prompt = "Once upon a time"
    ptoks = s.tokenize(prompt)
    n, T = 8, 0.7
    for seed in (11, 12, 13):
        a = s.generate(prompt, n, temperature=T, seed=seed)
        assert s.generate(prompt, n, temperature=T, seed=seed).tokens == a.tokens  # reproducible
        u = mt19937_uniforms(seed, len(a.tokens))
        for i, (lo, hi) in enumerate(cdf_positions(s, ptoks, a.tokens, T)):
            tol = 0.0 if i == 0 else 0.01
            assert lo - tol <= u[i] < hi + tol, (seed, i, a.tokens[i], lo, u[i], hi)
    assert s.generate(prompt, n, temperature=T, seed=11).tokens != s.generate(prompt, n, temperature=T, seed=12).tokens
    greedy = s.generate(prompt, n)
    assert s.generate(prompt, n, temperature=1e-4, seed=5).tokens == greedy.tokens  # T -> 0 is argmax
    assert s.generate(prompt, n, temperature=0.0, seed=5).tokens == greedy.tokens
    # llama.cpp's top-k filter: k = 1 leaves the argmax whatever the temperature
    assert s.generate(prompt, n, temperature=5.0, seed=5, top_k=1).tokens == greedy.tokens
