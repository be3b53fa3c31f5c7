"""The experiment harness's dependencies, which only the ``train`` extra installs.

``dynadiag_jax.training`` and ``dynadiag_jax.data`` check for theirs before anything else, so that
without the extra their import names the command that installs it instead of the first missing
module. The layer library needs none of them.
"""

from __future__ import annotations

import importlib.util

INSTALL = 'pip install "dynadiag-jax[train]"'


def require(package: str, modules: tuple[str, ...]) -> None:
    """Raise ``ImportError`` naming the ``train`` extra if one of ``modules`` is not installed."""
    missing = [m for m in modules if not _installed(m)]
    if missing:
        raise ImportError(
            f"{package} is part of the experiment harness and needs {', '.join(missing)}, which "
            f"the train extra installs: {INSTALL}"
        )


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # an import hook that refuses it
        return False
