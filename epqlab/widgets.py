"""Live views for JupyterLab (ipywidgets): :class:`ArenaView` shows a Session's arena slot by slot,
grouped by MoE layer, with the hit rate and SSD MB/token, updating while a stream runs."""
from __future__ import annotations

import html

COLORS = {"absent": "#e5e7eb", "resident": "#16a34a", "pinned": "#f59e0b", "hot": "#2563eb"}
LEGEND = {"absent": "not in the arena", "resident": "resident", "pinned": "pinned", "hot": "hot (static policy)"}


class ArenaView:
    """A live picture of ``session``'s expert arena.

    One row per MoE layer (GGUF block): one cell per expert, coloured by its state — resident
    (green), pinned (amber: held by the layer being computed), hot (blue: a ``static`` policy hot
    expert), or not in the arena (grey, ``"absent"``) — and a summary line: slots resident / pinned / free,
    hit rate and SSD MB/token (1e6 bytes) of the expert reads since the view started or was last
    :meth:`reset`, per generated token while :meth:`watch` runs.

    Use: ``view = ArenaView(s); display(view); for piece in view.watch(s.stream(prompt, 64)): ...``
    (or ``view.stream(prompt, 64)``), which refreshes the view every ``every`` tokens. :attr:`state`
    holds the numbers shown (for tests and logs).

    Raises:
        ValueError: the session runs without the pager (``pager=False``): there is no arena.
    """

    def __init__(self, session, every: int = 1):
        import ipywidgets as W

        if session.pager is None:
            raise ValueError("ArenaView needs a paged Session (pager=True): with pager=False there is no arena")
        self.session = session
        self.every = max(1, int(every))
        self.title = W.HTML()
        self.grid = W.HTML()
        self.hit = W.FloatProgress(min=0.0, max=1.0, description="hit rate", bar_style="success")
        self.label = W.HTML()
        self.widget = W.VBox([self.title, W.HBox([self.hit, self.label]), self.grid])
        self.state: dict = {}
        self.reset()

    # -- numbers -----------------------------------------------------------------------------------
    def reset(self) -> None:
        """Start the hit-rate and MB/token window now."""
        st = self.session.pager.stats
        self._base = (st["hits"], st["requests"], st["bytes_read"])
        self._tokens = 0
        self.refresh()

    def refresh(self, tokens: int | None = None) -> dict:
        """Read the pager and redraw; ``tokens``: tokens generated in the window so far. Returns :attr:`state`."""
        if tokens is not None:
            self._tokens = int(tokens)
        pg = self.session.pager
        ss = pg.slot_states()
        st = pg.stats
        lay = self.session.layout
        used = ss["layer"] >= 0
        layers = {int(b): ["absent"] * lay.n_expert for b in lay.moe_layers}
        for b, e, pin, hot in zip(ss["layer"][used], ss["expert"][used], ss["pinned"][used], ss["hot"][used]):
            layers[int(b)][int(e)] = "pinned" if pin else ("hot" if hot else "resident")
        h0, r0, b0 = self._base
        req = st["requests"] - r0
        self.state = {
            "slots": int(len(ss["layer"])), "resident": int(used.sum()), "pinned": int(ss["pinned"].sum()),
            "free": int((~used).sum()), "layers": layers, "tokens": self._tokens,
            "hits": st["hits"] - h0, "requests": req, "hit_rate": (st["hits"] - h0) / req if req else 0.0,
            "ssd_bytes": st["bytes_read"] - b0,
            "ssd_mb_per_token": (st["bytes_read"] - b0) / 1e6 / self._tokens if self._tokens else 0.0,
        }
        self._draw()
        return self.state

    # -- drawing -----------------------------------------------------------------------------------
    def _draw(self) -> None:
        s = self.state
        self.title.value = (f"<b>{html.escape(self.session.layout.path.name)}</b> — arena "
                            f"{self.session.pager.arena_bytes / 2**20:.1f} MiB, {s['slots']} slots: "
                            f"{s['resident']} resident ({s['pinned']} pinned), {s['free']} free")
        self.hit.value = s["hit_rate"]
        self.label.value = (f"{s['hit_rate']:.1%} of {s['requests']} requests &nbsp;|&nbsp; SSD "
                            f"{s['ssd_mb_per_token']:.2f} MB/token over {s['tokens']} tokens")
        cell = ('<span title="expert {e}: {st}" style="display:inline-block;width:8px;height:12px;margin:0 1px 0 0;'
                'background:{c}"></span>')
        rows = []
        for b, states in s["layers"].items():
            cells = "".join(cell.format(e=e, st=x, c=COLORS[x]) for e, x in enumerate(states))
            rows.append(f'<div style="font:11px monospace;line-height:14px;white-space:pre">blk.{b:<3d} {cells}</div>')
        legend = " ".join(f'<span style="background:{c};padding:0 6px">&nbsp;</span> {LEGEND[k]}' for k, c in COLORS.items())
        self.grid.value = "".join(rows) + f'<div style="font:11px sans-serif;margin-top:4px">{legend}</div>'

    # -- live --------------------------------------------------------------------------------------
    def watch(self, stream):
        """Yield the pieces of ``stream`` (a :class:`epqlab.Stream`) and refresh every ``every``
        generated tokens and at the end."""
        self.reset()
        n = 0
        try:
            for piece in stream:
                n = len(getattr(stream, "tokens", ())) or n + 1
                if n % self.every == 0:
                    self.refresh(n)
                yield piece
        finally:
            self.refresh(len(getattr(stream, "tokens", ())) or n)

    def stream(self, prompt, *args, **kw):
        """``watch(session.stream(prompt, ...))``."""
        return self.watch(self.session.stream(prompt, *args, **kw))

    def _repr_mimebundle_(self, **kw):
        return self.widget._repr_mimebundle_(**kw)

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


__all__ = ["ArenaView"]
