"""Data parallelism over several (fake) CPU devices: same training as on one device."""

import json
import pathlib

import jax
import numpy as np
from training_helpers import train_tiny

HERE = pathlib.Path(__file__).resolve().parent
FOUR_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}


def test_four_devices_train_like_one(run_python):
    proc = run_python([str(HERE / "train_child.py"), "-", "--steps", "6"], env=FOUR_DEVICES)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4 and out["param_devices"] == 4  # replicated on every device
    single = train_tiny(num_steps=6, eval_every=4)
    # The batch is split over four devices; only the summation order of the gradient differs.
    assert out["eval"]["accuracy"] == single.eval_metrics["accuracy"]
    np.testing.assert_allclose(out["eval"]["loss"], single.eval_metrics["loss"], rtol=1e-5)
    first = [np.asarray(x).ravel()[:8] for x in jax.tree.leaves(single.state.params)]
    for a, b in zip(out["params"], first, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_batch_not_divisible_by_four_devices(run_python):
    proc = run_python(
        [str(HERE / "train_child.py"), "-", "--batch", "6"], env=FOUR_DEVICES, check=False
    )
    assert proc.returncode != 0
    assert (
        "batch_size=6 is not divisible by the number of devices (4); use a multiple of 4"
        in proc.stderr
    )
