"""Strict numerics for every test: no silent dtype or rank promotion."""

import jax
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def rng():
    """A fresh numpy Generator with a fixed seed per test."""
    import numpy as np

    return np.random.default_rng(0)
