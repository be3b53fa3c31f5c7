"""The training library behind every script in ``train/``: explicit arguments, no configs.

:func:`train` runs the loop (search phase with a gate schedule, freeze, an optional fine-tuning
phase (:class:`Finetune`), an optional working-set form of the search (:class:`WorkingSet`),
evaluation, metrics to TensorBoard and JSONL, Orbax checkpoints, data
parallelism over every device).
"""

from dynadiag_jax import _train_extra

_train_extra.require(__name__, ("orbax.checkpoint", "tensorboardX", "tqdm"))

from dynadiag_jax.training.checkpoint import Checkpointer, CheckpointMismatch
from dynadiag_jax.training.finetune import Finetune, enter_finetune
from dynadiag_jax.training.loop import BatchSource, Interrupted, TrainResult, evaluate, train
from dynadiag_jax.training.metrics import MetricWriter, append_jsonl, read_jsonl
from dynadiag_jax.training.mixup import MixupCutmix
from dynadiag_jax.training.optimizer import (
    NO_DECAY,
    adamw,
    merge_params,
    split_params,
    train_only,
)
from dynadiag_jax.training.parallel import (
    check_batch_size,
    data_mesh,
    global_batch,
    initialize_distributed,
    step_batch,
)
from dynadiag_jax.training.sparsity import (
    GateSchedule,
    ParameterCounts,
    apply_gate,
    freeze_state,
    is_searching,
    kept_offsets,
    layer_metrics,
    parameter_counts,
)
from dynadiag_jax.training.state import TrainState, create_train_state, seed_key, variables_of
from dynadiag_jax.training.steps import make_eval_step, make_train_step
from dynadiag_jax.training.tasks import Classification, Distillation, LanguageModeling
from dynadiag_jax.training.working_set import (
    STORE_COLLECTION,
    WorkingSet,
    enter_working_set,
    has_working_set,
    leave_working_set,
    refresh_working_set,
    working_set_width,
)

__all__ = [
    "BatchSource",
    "CheckpointMismatch",
    "Checkpointer",
    "Classification",
    "Distillation",
    "Finetune",
    "GateSchedule",
    "Interrupted",
    "LanguageModeling",
    "MetricWriter",
    "MixupCutmix",
    "NO_DECAY",
    "STORE_COLLECTION",
    "ParameterCounts",
    "TrainResult",
    "TrainState",
    "adamw",
    "append_jsonl",
    "apply_gate",
    "check_batch_size",
    "create_train_state",
    "data_mesh",
    "enter_finetune",
    "evaluate",
    "freeze_state",
    "global_batch",
    "initialize_distributed",
    "is_searching",
    "kept_offsets",
    "layer_metrics",
    "make_eval_step",
    "make_train_step",
    "merge_params",
    "parameter_counts",
    "read_jsonl",
    "seed_key",
    "split_params",
    "step_batch",
    "train",
    "train_only",
    "variables_of",
    "WorkingSet",
    "enter_working_set",
    "has_working_set",
    "leave_working_set",
    "refresh_working_set",
    "working_set_width",
]
