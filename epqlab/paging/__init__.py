"""The pager's Python face and the device it reads from, with no llama.cpp in the process.

- :mod:`.pager`: :class:`Pager`, the native arena of expert slots (``epqlab._pager_core``), and
  route-log replay; eviction policies and their sources in ``help(Pager)``.
- :mod:`.probe`: :func:`probe_io`, the device measurement (latency and bandwidth per request size
  and reads in flight); its tables and reading for studies are :mod:`epqlab.studies.probe_report`.
- :mod:`.read_segments`: the read-segment size a probe table recommends.
- :mod:`.native`: loads ``epqlab._pager_core``.

Never imports :mod:`epqlab.engine` or ``llama_cpp`` (tests/test_layers.py).
"""
from __future__ import annotations

from .pager import MAX_IO_THREADS, POLICIES, Pager, default_io_threads
from .probe import probe_io

__all__ = ["Pager", "POLICIES", "MAX_IO_THREADS", "default_io_threads", "probe_io"]
