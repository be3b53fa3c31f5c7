"""Compile a run's later programs on a background thread while the run does something else.

A DynaDiag run compiles four programs besides its initial state: the search-phase step, the
freeze, the frozen step and the frozen evaluation. Compiled one after another on the main thread,
they stall the run twice (at the first step and at the freeze) for as long as XLA takes, which on a
small model is longer than the search itself. :class:`CompileAhead` lowers and compiles a jitted
function for abstract arguments on one worker thread; XLA releases the GIL while it compiles, so
the main thread keeps initialising or training meanwhile. The program lands in ``jax.jit``'s own
cache, so the run's ordinary call later finds it there and does not compile again - provided the
abstract arguments match the real ones exactly, shardings included
(``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``: an array's sharding is part of the key).

Nothing changes numerically: the program compiled ahead is the one the call would compile.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Hashable

__all__ = ["CompileAhead"]


class CompileAhead:
    """Named background compiles: ``submit`` starts one, ``wait`` blocks until it is done.

    Call :meth:`wait` before the first real call of a submitted program: a call made while the
    same program is still compiling would compile it a second time in parallel. A compile that
    fails is not reported here; the real call then compiles and raises the error itself, with
    the caller's traceback. Use as a context manager (or call :meth:`close`): leaving waits for a
    compile in progress, which XLA cannot cancel, and drops those not started.

    A compile shares the host's cores with the steps that run meanwhile, so steps timed beside one
    are slower than the step itself: :meth:`busy_since` says whether an interval saw one.
    """

    def __init__(self, clock=time.perf_counter):
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="compile-ahead"
        )
        self._pending: dict[Hashable, concurrent.futures.Future] = {}
        self._clock = clock
        self._lock = threading.Lock()
        self._running = False
        self._last_end = -float("inf")
        self._closed = False

    def submit(self, name: Hashable, fn, *args) -> None:
        """Compile the jitted ``fn`` for ``args`` (arrays, ``jax.ShapeDtypeStruct``s, or
        zero-argument callables that return them, called on the worker thread when its turn
        comes: what is costly to build, like a batch read from the data, is then built there).
        A name already pending is left as it is."""
        if name in self._pending:
            return

        def compile_():
            with self._lock:
                self._running = True
            try:
                fn.lower(*(a() if callable(a) else a for a in args)).compile()
            finally:
                with self._lock:
                    self._running, self._last_end = False, self._clock()

        self._pending[name] = self._pool.submit(compile_)

    def busy_since(self, start: float) -> bool:
        """Whether a compile ran at any time from ``start`` (a time of the clock) until now."""
        with self._lock:
            return self._running or self._last_end > start

    def pending(self) -> tuple[Hashable, ...]:
        """The names submitted and not yet waited for."""
        return tuple(self._pending)

    def wait(self, name: Hashable) -> None:
        """Block until ``name``'s compile is finished (or failed); a no-op if it was never
        submitted or was already waited for."""
        future = self._pending.pop(name, None)
        if future is not None:
            concurrent.futures.wait([future])

    def close(self, wait: bool = True) -> None:
        """Drop the compiles not started and, with ``wait``, wait for the one running (XLA
        cannot cancel it). Without, it finishes on its thread unawaited: what an interrupt wants,
        since a compile can take minutes. Only the first call does anything."""
        self._pending.clear()
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=wait, cancel_futures=True)

    def __enter__(self) -> CompileAhead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
