"""Optional dependencies. Serving (the router, the model replicas, online calibration) needs none
of them; grading, the benchmarks' plots and the calibration job's report do: the ``eval`` extra
(``pip install 'relay-serve[eval]'``; ``make serve`` and ``make test`` install it)."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

EXTRA_OF = {"matplotlib": "eval", "math_verify": "eval"}


class MissingExtra(ImportError):
    """An optional dependency is not installed: the message names the extra that brings it."""


def need(module: str) -> ModuleType:
    """``import module``, or a :class:`MissingExtra` naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.partition(".")[0]
        extra = EXTRA_OF.get(top)
        if extra is None:
            raise
        raise MissingExtra(
            f"{top} is not installed: pip install 'relay-serve[{extra}]' (grading, plots and "
            "calibration reports need it; serving does not)"
        ) from e


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (no display on a server or a Ray worker)."""
    matplotlib = need("matplotlib")
    matplotlib.use("Agg")
    return need("matplotlib.pyplot")
