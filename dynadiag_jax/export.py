"""``dd.export``: ``jax.export.export`` for functions that call dynadiag's kernels.

``jax.export`` refuses to serialize custom calls whose targets it does not know to be stable.
Ours are: every target name carries its ABI version (``dynadiag_diag_matmul_v2_fwd``; a changed ABI
registers a new name, docs/kernel_abi.md), so a serialized module either finds the ABI it was
built against or fails to find its target - never runs a mismatched kernel. ``export`` allows
exactly those targets. Deserialize and call in a process that has imported ``dynadiag_jax``
(importing it registers the targets).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.export import DisabledSafetyCheck, Exported

from dynadiag_jax._extension import custom_call_targets

__all__ = ["export"]


def export(
    fun_jit,
    *,
    platforms: Sequence[str] | None = None,
    disabled_checks: Sequence[DisabledSafetyCheck] = (),
) -> Callable[..., Exported]:
    """Like :func:`jax.export.export`, with dynadiag's custom-call targets allowed.

    Args:
      fun_jit: a ``jax.jit``-wrapped function (a plain callable is wrapped in ``jax.jit``).
      platforms: lowering platforms, e.g. ``("cpu", "cuda")`` (one name alone: ``"cuda"``);
        default: the default backend's.
      disabled_checks: further safety checks to skip, as for ``jax.export.export``.

    Returns:
      A function of the arguments (or their ``jax.ShapeDtypeStruct``) returning a
      :class:`jax.export.Exported`; ``.serialize()`` gives bytes that
      ``jax.export.deserialize`` reads back.

    The leading (row) dimensions of each ``diag_matmul``'s ``x`` may be symbolic, e.g. a batch
    from ``jax.export.symbolic_shape("b")``, so one program serves every batch size; feature
    widths and the diagonals must be concrete. ``impl="auto"`` then takes the choice it makes at
    both 1 and 2**20 rows where the two agree, else ``"dense"``, and ``"dense"`` on CUDA, whose
    kernels size their workspaces for a concrete row count (``ops/auto.py``). An explicit
    ``impl="ffi"`` exported for a platform without kernels (``"tpu"``, ``"rocm"``) raises
    ``NotImplementedError`` naming it; ``"auto"`` and ``"jax"`` lower for any platform.
    """
    if not hasattr(fun_jit, "trace"):
        fun_jit = jax.jit(fun_jit)
    # one name or one check, not a sequence of them: a string was exported for ('c', 'p', 'u')
    if isinstance(platforms, str):
        platforms = (platforms,)
    if isinstance(disabled_checks, DisabledSafetyCheck):
        disabled_checks = (disabled_checks,)
    ours = tuple(DisabledSafetyCheck.custom_call(name) for name in custom_call_targets())
    return jax.export.export(
        fun_jit, platforms=platforms, disabled_checks=(*disabled_checks, *ours)
    )
