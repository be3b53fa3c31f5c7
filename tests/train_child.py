"""A tiny training run in its own process, for the multi-device and kill-and-resume tests.

  python train_child.py WORKDIR [--steps N] [--sparsity S --freeze F] [--kill-at STEP]
                                [--step-sleep SECONDS] [--batch B] [--log-every N]

One of several processes when JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID are set.

Prints one JSON line: the final evaluation, the step it started from, the device count and a
checksum of the parameters. ``--kill-at`` sends SIGKILL to itself right after that step.
"""

import argparse
import json
import os
import signal
import sys
import time

import jax
import numpy as np
from training_helpers import train_tiny

from dynadiag_jax import training as T

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes talk through gloo


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--sparsity", type=float, default=None)
    parser.add_argument("--freeze", type=int, default=None)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--log-every", type=int, default=1)
    args = parser.parse_args()
    T.initialize_distributed()  # several processes when JAX_NUM_PROCESSES etc. are set

    def hook(step, state):
        if args.kill_at is not None and step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(args.step_sleep)

    workdir = None if args.workdir == "-" else args.workdir
    result = train_tiny(
        workdir,
        num_steps=args.steps,
        sparsity=args.sparsity,
        freeze_step=args.freeze,
        batch_size=args.batch,
        eval_every=4,
        selection_every=2,
        log_every=args.log_every,
        hooks=[hook],
    )
    leaves = jax.device_get(jax.tree.leaves(result.state.params))
    print(
        json.dumps(
            {
                "eval": result.eval_metrics,
                "start_step": result.start_step,
                "devices": jax.device_count(),
                "process": jax.process_index(),
                "param_devices": len(jax.tree.leaves(result.state.params)[0].sharding.device_set),
                "param_sum": float(sum(np.abs(np.asarray(x, np.float64)).sum() for x in leaves)),
                "params": [np.asarray(x).ravel()[:8].tolist() for x in leaves],
            }
        )
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
