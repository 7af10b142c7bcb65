"""Names a package offers from its submodules, imported on first use (PEP 562), so importing the package costs
nothing: ``ddpkit.parallel.ddp.DistributedDataParallel`` without ``import torch`` for whoever reads only
``ddpkit.parallel.common.bucket_caps``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy"]


def lazy(package: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that finds each name of ``homes`` in its submodule.

    Example (a package's ``__init__``)::

        __getattr__ = lazy(__name__, {"DistributedDataParallel": "wrapper"})
    """
    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{homes[name]}"), name)

    return __getattr__
