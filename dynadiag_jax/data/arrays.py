"""Batches from in-memory arrays: shuffled training batches by step, padded evaluation batches.

Training order is a pure function of ``(seed, step)``: epoch ``e`` is the permutation
``default_rng([seed, e])``, and step ``t`` takes slice ``t % steps_per_epoch`` of it. A resumed run
therefore sees exactly the batches an uninterrupted one would. With several processes each one
yields its contiguous share of every global batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import jax
import numpy as np

from dynadiag_jax._checks import int_at_least, int_in_range

__all__ = ["ArrayBatches", "EvalBatches"]


def _check_arrays(arrays: Mapping[str, np.ndarray]) -> int:
    if not arrays:
        raise ValueError("arrays must hold at least one array")
    lengths = {k: len(v) for k, v in arrays.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"arrays must have the same length, got {lengths}")
    return next(iter(lengths.values()))


def _shapes(arrays: Mapping[str, np.ndarray]) -> dict:
    return {k: tuple(np.shape(v)) for k, v in arrays.items()}


def _process_share(global_batch_size: int, process_index, process_count):
    pc = int_at_least(
        jax.process_count() if process_count is None else process_count, "process_count", 1
    )
    pi = jax.process_index() if process_index is None else process_index
    pi = int_in_range(pi, "process_index", 0, pc - 1, "[0, process_count - 1]")
    if global_batch_size % pc:
        raise ValueError(
            f"batch size {global_batch_size} is not divisible by the number of processes ({pc})"
        )
    local = global_batch_size // pc
    return slice(pi * local, (pi + 1) * local)


class ArrayBatches:
    """Infinite shuffled training batches (the last incomplete batch of each epoch is dropped).

    Args:
      arrays: equal-length arrays, e.g. ``{"image": [N, 28, 28, 1], "label": [N]}``.
      global_batch_size: examples per step over all processes.
      seed: shuffling seed.
      process_index, process_count: default to JAX's.
    """

    def __init__(
        self,
        arrays: Mapping[str, np.ndarray],
        global_batch_size: int,
        *,
        seed: int,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        n = _check_arrays(arrays)
        int_at_least(global_batch_size, "batch size", 1)
        if global_batch_size > n:
            raise ValueError(f"batch size {global_batch_size} exceeds the {n} training examples")
        self.arrays = dict(arrays)
        self.global_batch_size = int(global_batch_size)
        self.seed = int_at_least(seed, "seed", 0)  # numpy's generators take no negative seed
        self.steps_per_epoch = n // global_batch_size
        self._share = _process_share(self.global_batch_size, process_index, process_count)
        self._num_examples = n

    def indices(self, step: int) -> np.ndarray:
        """Indices (into the arrays) of this process's examples at ``step``."""
        epoch, i = divmod(int(step), self.steps_per_epoch)
        perm = np.random.default_rng([self.seed, epoch]).permutation(self._num_examples)
        b = self.global_batch_size
        # sorted before it is shared: the processes' shares join into one process's batch
        return np.sort(perm[i * b : (i + 1) * b])[self._share]

    def iterate(self, start_step: int) -> Iterator[dict[str, np.ndarray]]:
        """Batches of steps ``start_step, start_step + 1, ...``."""
        step, epoch, perm = int(start_step), None, None
        b = self.global_batch_size
        while True:
            e, i = divmod(step, self.steps_per_epoch)
            if e != epoch:
                epoch, perm = (
                    e,
                    np.random.default_rng([self.seed, e]).permutation(self._num_examples),
                )
            idx = np.sort(perm[i * b : (i + 1) * b])[self._share]
            yield {k: v[idx] for k, v in self.arrays.items()}
            step += 1


class EvalBatches:
    """Every example once, in order, in batches padded to ``global_batch_size`` with a ``"mask"``.

    Re-iterable; each iteration yields this process's share of every global batch.
    """

    def __init__(
        self,
        arrays: Mapping[str, np.ndarray],
        global_batch_size: int,
        *,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        self.num_examples = _check_arrays(arrays)
        if not self.num_examples:  # else the run trains and fails at its first evaluation
            raise ValueError(f"arrays hold no example to evaluate: {_shapes(arrays)}")
        int_at_least(global_batch_size, "batch size", 1)
        self.arrays = dict(arrays)
        self.global_batch_size = int(global_batch_size)
        self._share = _process_share(self.global_batch_size, process_index, process_count)

    def __len__(self) -> int:
        return -(-self.num_examples // self.global_batch_size)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        b = self.global_batch_size
        for start in range(0, self.num_examples, b):
            idx = np.arange(start, start + b)
            mask = idx < self.num_examples
            idx = np.where(mask, idx, 0)[self._share]
            batch = {k: v[idx] for k, v in self.arrays.items()}
            batch["mask"] = mask[self._share].astype(np.float32)
            yield batch
