"""The MTP speculation study: does drafting with the model's MTP block pay when the experts stream from disk?
(docs/DESIGN.md §3g; bench/bench_mtp.py runs it under memory limits.)

A random-weight model drafts nonsense, so acceptance is *set*, not measured: the Session's study mode
(:meth:`epqlab.Session.stream` with ``forced`` and ``draft_accept=a``) feeds held-out text one token per position,
drafts the text's next tokens with each replaced by a wrong one with probability 1 - a, and accepts them while they
equal the text. Every MTP draft pass, verify pass, catch-up pass and rollback runs, so the time and the bytes are
the mechanism's own. :func:`measure` returns one row: speeds beside the time per verify pass, per draft pass and per
catch-up pass, the union of experts a verify pass reads per layer and the SSD bytes per generated token.
"""
from __future__ import annotations

from .batching import forced_sequences


def measure(session, n_predict: int, *, accept: float | None = None, prompt_tokens: int = 32, seed: int = 0,
            window: int = 0) -> dict:
    """One teacher-forced generation of ``n_predict`` tokens of held-out text (window ``window`` of
    :func:`epqlab.studies.batching.forced_sequences`) on ``session``: with its ``speculative="mtp"`` at acceptance
    ``accept`` (a in 0..1), or without speculation (``accept`` None, the session without ``speculative``).

    Returns a dict: ``tok_s`` (generated tokens from decode per second), ``ms_per_token``, ``n_gen``,
    ``ssd_mb_per_token`` (MB = 1e6 bytes of expert reads per generated token), ``decode_hit_rate``; with speculation
    also ``verify_ms`` (a target pass over 1 + d tokens), ``draft_ms`` (one MTP draft pass), ``catchup_ms`` (the MTP
    pass that follows a target pass), ``acceptance`` (accepted / drafted), ``tokens_per_verify`` ((accepted +
    target passes) / target passes), ``verify_union`` (distinct experts per trunk layer and target pass),
    ``mtp_union``; ``io_ms``: the I/O wait of the decode phase per generated token.

    Raises:
        ValueError: ``accept`` with a session without speculation, or the reverse.
    """
    if (accept is None) != (session.speculative is None):
        raise ValueError("accept goes with a speculative='mtp' Session, and only with one")
    prompt, forced = forced_sequences(session, window + 1, prompt_tokens, n_predict)[window]
    session.reset_stats()
    st = session.stream(prompt, n_predict, forced=forced, draft_accept=accept, draft_seed=seed)
    for _ in st:
        pass
    s = st.stats
    n_dec = max(1, s["n_gen"] - 1)
    row = {"accept": accept, "draft_max": session.draft_max or 0, "n_gen": s["n_gen"], "tok_s": s["decode_tok_s"],
           "ms_per_token": 1000 * s["decode_s"] / n_dec, "ssd_mb_per_token": s["decode_ssd_bytes_per_token"] / 1e6,
           "decode_hit_rate": s["decode_hit_rate"], "io_ms": 1000 * s["decode_io_wait_s"] / n_dec}
    if accept is not None:
        target = s["spec_verify_steps"] + s["spec_plain_steps"]
        row.update(verify_ms=1000 * s["spec_verify_s"] / max(1, target),
                   draft_ms=1000 * s["spec_draft_s"] / max(1, s["spec_draft_passes"]),
                   catchup_ms=1000 * s["spec_catchup_s"] / max(1, target),
                   acceptance=s["spec_acceptance"], tokens_per_verify=(s["spec_accepted"] + target) / max(1, target),
                   verify_union=s.get("spec_verify_union", 0.0), mtp_union=s.get("spec_mtp_union", 0.0),
                   drafted=s["spec_drafted"], accepted=s["spec_accepted"], target_passes=target)
    else:
        row.update(verify_ms=1000 * s["decode_s"] / n_dec)
    return row


__all__ = ["measure"]
