"""How :mod:`epqlab.requests.completion` runs its choices: prompts as token lists, the
:class:`~epqlab.engine.sampling.Sampler` of each choice (its seed, grammar, penalties, logit bias,
log-probabilities), and one event stream for both ways of decoding them: one prompt and one choice
in-process decode as a :class:`~epqlab.engine.generation.Stream` that keeps the KV cache of the previous call
when it prefixes the prompt (as llama-cpp-python does); anything else (``n`` > 1, several prompts, the
server's background :class:`~epqlab.engine.batch.Batcher`) as sequences of one batch.

Events: ``("piece", choice, text, logprob_records)`` as text is produced (the records of the tokens since
the previous piece, when log-probabilities were asked for, else None) and ``("end", choice, Generation,
extra, logprob_records)``, ``extra`` None except on the last choice to end, where it carries ``usage`` and
``epqlab`` (once per call); the records (:attr:`~epqlab.engine.sampling.Sampler.logprobs`) there are those of
every generated token.
"""
from __future__ import annotations

import numbers
import queue
import threading
from collections.abc import Iterator, Sequence

from ..engine.batch import Batcher, Request
from ..engine.generation import Generation, Stream
from ..engine.sampling import Sampler
from ..errors import ContextFullError
from ..results import clean_json
from .structured import vocab_of

MAX_CHOICES = 128  # n x prompts per call
CANCEL_POLL_S = 0.1  # how often a wait on a background batcher looks at its cancel event


def _stop_list(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, (list, tuple)) and all(isinstance(x, str) for x in stop):
        return list(stop)
    raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")


def _max_tokens(session, max_tokens, n_prompt: int, strict: bool = False) -> int:
    """Tokens a choice may generate: llama-cpp-python's rule (None or <= 0: until the context is full; more
    than fits: clamped), or with ``strict`` (the server, as OpenAI's API) a ValueError when the prompt plus
    ``max_tokens`` exceed the context. Both refusals (and a prompt that leaves no room) are
    :class:`~epqlab.errors.ContextFullError`, a ValueError whose fix a server words in its own flags."""
    room = session.n_ctx - n_prompt
    if room < 1:
        raise ContextFullError(f"the prompt has {n_prompt} tokens, which leaves no room in the context of "
                               f"{session.n_ctx}; shorten it or {{fix}}")
    if max_tokens is None or (isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens <= 0):
        return room  # llama-cpp-python: None or <= 0 means "until the context is full"
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise ValueError(f"max_tokens must be an integer, got {max_tokens!r}")
    if strict and max_tokens > room:
        raise ContextFullError(f"max_tokens={max_tokens} plus the prompt's {n_prompt} tokens exceed the context of "
                               f"{session.n_ctx} tokens; ask for at most {room} (or {{fix}})")
    return min(max_tokens, room)


def _usage(n_prompt: int, n_gen: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}


def prompt_list(session, prompt) -> list[list[int]]:
    """The prompts of a completions request as token-id lists: a str, a list of str, a list of ints (one
    prompt), or a list of int lists (OpenAI's ``prompt`` forms). Raises TypeError / ValueError naming the
    form that is wrong."""
    if isinstance(prompt, str):
        return [session.prompt_tokens(prompt, True)]
    if isinstance(prompt, (bytes, bytearray)) or prompt is None or not isinstance(prompt, Sequence):
        raise TypeError("prompt must be a str, a list of str, a list of token ids or a list of token-id lists, "
                        f"got {type(prompt).__name__}")
    if not prompt:
        raise ValueError("empty prompt: pass some text or at least one token id")
    if all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in prompt):
        return [session.prompt_tokens(list(prompt), True)]
    if all(isinstance(x, str) for x in prompt):
        return [session.prompt_tokens(x, True) for x in prompt]
    if all(isinstance(x, Sequence) and not isinstance(x, (str, bytes)) for x in prompt):
        return [session.prompt_tokens(list(x), True) for x in prompt]
    if all(isinstance(x, numbers.Number) and not isinstance(x, bool) for x in prompt):
        raise TypeError(f"token ids must be integers, got {type(next(x for x in prompt if not isinstance(x, numbers.Integral))).__name__}")
    raise TypeError("prompt must be a str, a list of str, a list of token ids or a list of token-id lists; "
                    "this list mixes them")


def _check_n(n) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"n must be an integer >= 1 (choices per prompt), got {n!r}")
    return int(n)


def _requests(session, prompts: list[list[int]], n: int, max_tokens, stops, seed, sampling: dict,
              events: queue.SimpleQueue, strict: bool = False) -> list[Request]:
    if len(prompts) * n > MAX_CHOICES:
        raise ValueError(f"{len(prompts)} prompts x n={n} is more than {MAX_CHOICES} choices in one call")
    out = []
    for i, toks in enumerate(prompts):
        m = _max_tokens(session, max_tokens, len(toks), strict)
        for j in range(n):
            c = i * n + j
            sd = None if seed is None else (int(seed) + c) % 2**32
            out.append(Request(toks, m, make_sampler(session, sd, sampling), stops, index=c, events=events))
    return out


def batch_events(session, reqs: list[Request], batcher: Batcher | None = None,
                 cancel: threading.Event | None = None) -> Iterator[tuple]:
    """``("piece", choice, text)`` and ``("done", choice, None)`` of ``reqs`` as they happen: on ``batcher``
    when given (a background one: the server's), else on a Batcher driven here, step by step. Closing the
    iterator, or setting ``cancel``, cancels what is still running."""
    q = reqs[0].events
    local = batcher is None
    b = Batcher(session) if local else batcher
    for r in reqs:
        b.submit(r)
    left = len(reqs)
    try:
        while left:
            if cancel is not None and cancel.is_set():
                for r in reqs:
                    r.cancel()
            try:
                ev = q.get_nowait() if local else q.get(timeout=CANCEL_POLL_S)
            except queue.Empty:
                if not local:
                    continue
                try:
                    if not b.drive():
                        break
                except BaseException as e:
                    b.fail_all(e)  # every request ends (with this error); their events follow
                continue
            left -= ev[0] == "done"
            yield ev
    finally:
        for r in reqs:
            r.cancel()
        if local:
            try:
                while b.drive():  # let the cancelled sequences leave
                    pass
            except BaseException as e:  # noqa: BLE001 - already ending; the requests carry the error
                b.fail_all(e)


def _choice_events(session, reqs: list[Request], batcher, cancel, n_prompt: int,
                   pieces: bool = True) -> Iterator[tuple]:
    """:func:`batch_events` as the module docstring's events (``pieces`` False: the "end" events alone);
    raises the error that ended a choice."""
    left = len(reqs)
    seen = [0] * len(reqs)  # pieces seen per choice
    took = [0] * len(reqs)  # log-probability records handed out per choice
    for kind, c, value in batch_events(session, reqs, batcher, cancel):
        r = reqs[c]
        if kind == "piece":
            if not pieces:
                continue
            recs = None
            if r.sampler.n_logprobs is not None:
                end = r.piece_ends[seen[c]]
                recs, took[c] = r.sampler.logprobs[took[c]:end], end
            seen[c] += 1
            yield "piece", c, value, recs
            continue
        left -= 1
        if r.error is not None:
            raise r.error
        recs = _records(r.sampler, r.result)
        if left:
            yield "end", c, r.result, None, recs
        else:
            gens, usage, st = _batch_result(reqs, n_prompt)
            yield "end", c, gens[c], {"usage": usage, "epqlab": st}, recs


def _batch_result(reqs: list[Request], n_prompt: int) -> tuple[list, dict, dict]:
    """(generations, usage, epqlab stats) of finished requests (``n_prompt``: prompt tokens, each prompt
    counted once however many choices it has); raises the first request's error."""
    for r in reqs:
        if r.error is not None:
            raise r.error
    gens = [r.result for r in reqs]
    usage = _usage(n_prompt, sum(len(g.tokens) for g in gens))
    # one choice: its figures at the top, as a single generation's run stats are; every choice's under "choices"
    top = dict(gens[0].stats) if len(gens) == 1 else {"n_prompt": n_prompt}
    top.update(n_gen=usage["completion_tokens"], choices=[g.stats for g in gens])
    return gens, usage, clean_json(top)


def sampling_args(session, *, temperature, top_k, top_p, min_p, repeat_penalty, frequency_penalty=0.0,
                  presence_penalty=0.0, typical_p=1.0, logit_bias=None, mirostat_mode=0, mirostat_tau=5.0,
                  mirostat_eta=0.1, grammar: str | None = None, n_logprobs: int | None = None) -> dict:
    """The :class:`~epqlab.engine.sampling.Sampler` arguments of a request (the vocabulary loaded when a
    grammar needs it); a first Sampler is built and freed here so that a bad value raises before any work."""
    d = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
             frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, typical_p=typical_p,
             logit_bias=logit_bias, mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau,
             mirostat_eta=mirostat_eta, grammar=grammar or None, n_logprobs=n_logprobs)
    if grammar:
        d["vocab"] = vocab_of(session)
    Sampler(session.n_vocab, seed=0, **d).free()
    return d


def make_sampler(session, seed, sampling: dict) -> Sampler:
    return Sampler(session.n_vocab, seed=seed, **sampling)


def choice_events(session, prompts: list[list[int]], n: int, max_tokens, stops: list[str], seed, sampling: dict,
                  batcher: Batcher | None, cancel: threading.Event | None, strict: bool = False,
                  pieces: bool = True) -> Iterator[tuple]:
    """The events (module docstring) of ``n`` choices per prompt; raises ValueError / TypeError before any
    work for a bad request. ``pieces`` False (a request that is not streamed): the "end" events alone, and one
    prompt with one choice in-process runs to its end inside the runtime
    (:meth:`~epqlab.engine.generation.Stream.finish`) instead of coming back up with every piece."""
    if getattr(session, "speculative", None) and batcher is not None:
        # speculative decoding runs one sequence at a time (epqlab/engine/speculative.py): the server's requests
        # take turns on the session instead of joining the batcher
        if len(prompts) != 1 or n != 1:
            raise ValueError("this server decodes speculatively (speculative='mtp'), one sequence at a time: send one "
                             f"prompt with n=1 per request (got {len(prompts)} prompt(s), n={n})")
        toks = prompts[0]
        m = _max_tokens(session, max_tokens, len(toks), strict)
        return _serial_events(session, toks, m, make_sampler(session, seed, sampling), stops, cancel, pieces)
    if len(prompts) == 1 and n == 1 and batcher is None:
        toks = prompts[0]
        m = _max_tokens(session, max_tokens, len(toks), strict)
        return _single_events(session, toks, m, make_sampler(session, seed, sampling), stops, pieces)
    reqs = _requests(session, prompts, n, max_tokens, stops, seed, sampling, queue.SimpleQueue(), strict)
    return _choice_events(session, reqs, batcher, cancel, sum(len(t) for t in prompts), pieces)


def _single_events(session, toks: list[int], m: int, sampler: Sampler, stops: list[str],
                   pieces: bool = True) -> Iterator[tuple]:
    session.decoder.check_open()
    st = Stream(session, toks, m, sampler, stops, reuse_kv=True)
    took = 0
    try:  # no lock held across yields: a consumer may resume it from another thread
        if not pieces:
            st.finish()
        for piece in st:  # (nothing left after finish)
            recs = None
            if sampler.n_logprobs is not None:
                end = min(len(sampler.logprobs), len(st.tokens))
                recs, took = sampler.logprobs[took:end], end
            yield "piece", 0, piece, recs
    finally:
        st.close()
    g: Generation = st.result
    yield "end", 0, g, {"usage": _usage(len(toks), len(g.tokens)), "epqlab": clean_json(g.stats)}, _records(sampler, g)


def _serial_events(session, toks: list[int], m: int, sampler: Sampler, stops: list[str],
                   cancel: threading.Event | None, pieces: bool = True) -> Iterator[tuple]:
    """:func:`_single_events` in turn with the session's other serial requests: the Session's ``serial_turn``, a plain
    lock (released by whichever thread ends the iterator), taken when the first event is asked for and held until the
    generation ends."""
    turn = session.serial_turn
    while not turn.acquire(timeout=CANCEL_POLL_S):
        if cancel is not None and cancel.is_set():
            return
    try:
        yield from _single_events(session, toks, m, sampler, stops, pieces)
    finally:
        turn.release()


def cached_tokens(stats: dict, n: int) -> int:
    """Prompt tokens a request found in the prompt cache (OpenAI's ``usage.prompt_tokens_details.cached_tokens``),
    from its run stats (the ``epqlab`` of its last "end" event): each choice is a sequence prefilled on its own, so per
    prompt the fewest tokens any of its ``n`` choices reused (``n_prompt_reused``), summed over the prompts (usage
    counts each prompt once)."""
    reused = [int(c.get("n_prompt_reused", 0)) for c in (stats.get("choices") or [stats])]
    return sum(min(reused[i:i + n]) for i in range(0, len(reused), max(1, n)))


def with_cached_tokens(events: Iterator[tuple], n: int) -> Iterator[tuple]:
    """``events`` with ``usage.prompt_tokens_details.cached_tokens`` (:func:`cached_tokens`) in the one "end"
    event that carries the usage; closing it closes ``events``."""
    try:
        for ev in events:
            if ev[0] == "end" and ev[3]:
                ev[3]["usage"]["prompt_tokens_details"] = {"cached_tokens": cached_tokens(ev[3]["epqlab"], n)}
            yield ev
    finally:
        events.close()


def run_all(session, events: Iterator[tuple], local: bool) -> tuple[list, dict]:
    """Consume ``events`` to the end (holding the Session's lock when ``local``: an in-process run):
    ``([(Generation, logprob records | None)] by choice, extra)``."""
    out, extra = {}, {}
    if local:
        session.decoder.lock.acquire()
    try:
        for ev in events:
            if ev[0] == "end":
                out[ev[1]] = (ev[2], ev[4])
                extra = ev[3] or extra
    finally:
        if local:
            session.decoder.lock.release()
    return [out[c] for c in sorted(out)], extra


def matched_stop(session, gen: Generation, stops: list[str]) -> str | None:
    """The stop string that ended ``gen``, or None (an end-of-generation token, the length limit, no stop).
    ``gen.text`` is its tokens' text cut before the earliest stop string (:mod:`epqlab.engine.stop_text`), and the
    tokens run through that stop (an end-of-generation token is not among them), so the stop is the one that
    begins where the text ends; of several that begin there, the first in ``stops``."""
    if gen is None or gen.finish_reason != "stop":
        return None
    full = b"".join(session.decoder.piece(t) for t in gen.tokens).decode("utf-8", "ignore")
    return next((s for s in stops if s and full.startswith(s, len(gen.text))), None)


def _records(sampler: Sampler, gen: Generation | None) -> list | None:
    """The log-probability records of ``gen``'s tokens (the end-of-generation draw dropped), or None."""
    if sampler.n_logprobs is None or gen is None:
        return None
    return sampler.logprobs[:len(gen.tokens)]
