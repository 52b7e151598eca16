"""Studies built on the engine: each runs Sessions (or replays route logs) and returns tables.

- :mod:`.ablation`: eviction policy, top-k and skip-cold sweeps over arenas or budgets, the routing cap;
- :mod:`.strict` (hard memory limits per level; tables and figures in :mod:`.strict_report`, each run in
  :mod:`.strict_child`);
- :mod:`.sweeps` (any grid on any executor), :mod:`.route_recording` (route logs from a Session),
  :mod:`.probe_report` (the I/O probe's tables, figures and reading), :mod:`.model_quality` (perplexity and
  routing statistics of a model), :mod:`.predictor_fit` (fitting the trained prefetch predictor).

A study is ``run`` in ``<study>.py`` and its tables, figures, reading and JSON in ``<study>_report.py``.
"""
