"""``epqlab ablate <study> MODEL ...``: the ablation studies, one subcommand each. Each study lives in
``epqlab/commands/ablate_<name>.py`` and defines ``register(subparsers)``."""
from __future__ import annotations

import importlib

# Studies, in the order `epqlab ablate --help` lists them.
STUDIES = ["topk"]


def register(sub) -> None:
    p = sub.add_parser("ablate", help="ablation studies (top-k, ...) with tables, JSON and figures")
    studies = p.add_subparsers(dest="study", metavar="STUDY")
    for name in STUDIES:
        importlib.import_module(f".ablate_{name}", __package__).register(studies)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def split_list(value) -> list:
    """``"0.25,0.5,256MiB"`` -> ``[0.25, 0.5, "256MiB"]``: numbers where they parse, else strings."""
    if value is None:
        return None
    out = []
    for x in str(value).split(","):
        x = x.strip()
        if not x:
            continue
        try:
            out.append(float(x))
        except ValueError:
            out.append(x)
    return out


def model_path(model: str) -> str:
    """``default`` = the embedded default model (built on first use), else the path as given."""
    if model == "default":
        from ..models import default_model

        return str(default_model())
    return model
