"""What a model is trained to do: the loss and the evaluation metrics of a batch.

A task turns a batch (a dict of arrays) into model inputs and targets, computes the training loss,
and reduces evaluation batches to sums that add up across batches (so the last, padded batch of an
evaluation set counts only its real examples: batches carry a ``"mask"`` of 1s and 0s).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dynadiag_jax._checks import fraction, int_at_least
from dynadiag_jax._dtypes import promote_floats, work_dtype
from dynadiag_jax.training.mixup import MixupCutmix

__all__ = ["Classification", "Distillation", "LanguageModeling"]


def _mask(batch, n):
    return batch["mask"].astype(jnp.float32) if "mask" in batch else jnp.ones((n,), jnp.float32)


@dataclasses.dataclass(frozen=True)
class Classification:
    """Image (or any input) classification from ``{"image": [B, ...], "label": [B] int}``.

    Attributes:
      num_classes: number of classes (an int >= 2), the width of the model's logits.
      label_smoothing: mass spread uniformly over all classes in training targets, in ``[0, 1)``.
      mixup: batch mixing applied to training inputs (``None``: no mixing).
      normalize: ``(mean, std)`` per channel for uint8 images in [0, 255] (e.g.
        ``dynadiag_jax.data.IMAGENET_MEAN_STD``); ``None``: images are used as given.

    Raises:
      TypeError: ``num_classes`` not an int, ``label_smoothing`` not a number, ``mixup`` not
        callable.
      ValueError: ``num_classes`` < 2, ``label_smoothing`` outside ``[0, 1)``, a bad ``mixup``
        field; when a step is traced, logits whose width is not ``num_classes`` or labels that
        are not ``[B]``; :meth:`check_batch` (``train`` calls it on its first batch), a label
        outside ``[0, num_classes)``.

    Inside ``jit`` a label outside ``[0, num_classes)`` makes its example's training loss NaN
    (its one-hot target would be all zeros: a loss of 0, as if learned).
    """

    num_classes: int
    label_smoothing: float = 0.0
    mixup: MixupCutmix | None = None
    normalize: tuple | None = None

    def __post_init__(self):
        int_at_least(self.num_classes, "Classification: num_classes", 2)
        fraction(self.label_smoothing, "Classification: label_smoothing")
        if self.mixup is not None and not callable(self.mixup):
            raise TypeError(
                "Classification: mixup must be a MixupCutmix or None, "
                f"got {type(self.mixup).__name__}"
            )
        if isinstance(self.mixup, MixupCutmix):
            self.mixup.check()

    def check_batch(self, batch) -> None:
        """Raises ``ValueError`` when a (host) batch's labels are not classes of this task."""
        labels = np.asarray(batch["label"])
        bad = labels[(labels < 0) | (labels >= self.num_classes)]
        if bad.size:
            raise ValueError(
                f"Classification: labels must be in [0, num_classes={self.num_classes}), the "
                f"batch holds {bad.size} outside (e.g. {bad.flat[0]})"
            )

    @staticmethod
    def _labels(batch, n: int):
        """``batch["label"]``, checked to be ``[B]`` (a ``[B, 1]`` would broadcast the loss
        against every example's logits)."""
        labels = batch["label"]
        if labels.shape != (n,):
            raise ValueError(
                f"Classification: batch['label'] must have shape [B] = [{n}] (class indices), "
                f"got {list(labels.shape)}"
            )
        return labels

    def _check_width(self, logits):
        """Raises unless the logits (traced: their shape is static) are ``num_classes`` wide;
        else the first op to meet both would report mismatched shapes without naming them."""
        if logits.shape[-1] != self.num_classes:
            raise ValueError(
                f"Classification: num_classes={self.num_classes} differs from the width of the "
                f"model's logits ({logits.shape[-1]}): give the task the model's number of classes"
            )

    def _images(self, batch):
        images = batch["image"]
        if self.normalize is None:
            return images
        shape = (1,) * (images.ndim - 1) + (-1,)
        mean, std = (jnp.asarray(v, jnp.float32).reshape(shape) for v in self.normalize)
        return (images.astype(jnp.float32) / 255.0 - mean) / std

    def train_inputs(self, batch, key):
        """``(inputs, soft targets [B, num_classes])`` for a training step."""
        images = self._images(batch)
        labels = self._labels(batch, images.shape[0])
        known = (labels >= 0) & (labels < self.num_classes)
        targets = optax.smooth_labels(
            jax.nn.one_hot(labels, self.num_classes, dtype=jnp.float32), self.label_smoothing
        )
        targets = jnp.where(known[:, None], targets, jnp.nan)
        if self.mixup is not None:
            images, targets = self.mixup(key, images, targets)
        return images, targets

    def loss(self, logits, targets, batch):
        """Mean soft-target cross-entropy and the training metrics (accuracy vs the hard label)."""
        self._check_width(logits)
        work = promote_floats(logits.dtype, targets.dtype)  # float64 logits stay float64
        loss = optax.softmax_cross_entropy(logits.astype(work), targets.astype(work)).mean()
        accuracy = (jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32).mean()
        return loss, {"loss": loss, "accuracy": accuracy}

    def eval_inputs(self, batch):
        return self._images(batch)

    def eval_sums(self, logits, batch):
        """Sums of per-example loss and correct predictions over the unmasked examples."""
        self._check_width(logits)
        m = _mask(batch, logits.shape[0])
        labels = self._labels(batch, logits.shape[0])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
        return {"loss": (ce * m).sum(), "correct": (correct * m).sum(), "count": m.sum()}

    @staticmethod
    def summarise(sums):
        """``{"loss", "accuracy", "count"}`` from accumulated :meth:`eval_sums`."""
        n = max(float(sums["count"]), 1.0)
        return {
            "loss": float(sums["loss"]) / n,
            "accuracy": float(sums["correct"]) / n,
            "count": int(sums["count"]),
        }


@dataclasses.dataclass(frozen=True)
class Distillation:
    """A task trained towards a teacher's outputs too (knowledge distillation).

    The training loss is ``(1 - weight) * task loss + weight * T^2 * CE(softmax(t / T), s / T)``
    with ``s`` the model's logits, ``t = teacher(inputs)`` the teacher's on the same (augmented)
    inputs, without gradient, and ``T`` the temperature (the ``T^2`` keeps the soft term's
    gradient at the scale of the hard one); the soft term is averaged over every prediction (the
    examples, and the positions of a language model). Evaluation is the task's.

    Attributes:
      task: the :class:`Classification` task (its targets, label smoothing and mixup) or the
        :class:`LanguageModeling` task.
      teacher: ``inputs -> logits`` (``[B, num_classes]``, or ``[B, T, vocab]``), e.g.
        ``functools.partial(dense_model.apply, dense_variables)``; traced into the training
        step, so the teacher's variables are constants of the compiled step.
      weight: in ``[0, 1]``, the soft term's share.
      temperature: ``> 0``.
    """

    task: Classification
    teacher: Callable
    weight: float = 0.9
    temperature: float = 2.0

    def __post_init__(self):
        if not 0.0 <= float(self.weight) <= 1.0:
            raise ValueError(f"Distillation: weight must be in [0, 1], got {self.weight!r}")
        if not float(self.temperature) > 0.0:
            raise ValueError(f"Distillation: temperature must be > 0, got {self.temperature!r}")

    def train_inputs(self, batch, key):
        """``(inputs, (the task's targets, the teacher's logits))``."""
        inputs, targets = self.task.train_inputs(batch, key)
        teacher = jax.lax.stop_gradient(self.teacher(inputs))
        return inputs, (targets, teacher.astype(work_dtype(teacher.dtype)))

    def loss(self, logits, targets, batch):
        """The mixed loss; ``loss`` and ``soft_loss`` and the task's other metrics."""
        hard, teacher = targets
        task_loss, metrics = self.task.loss(logits, hard, batch)
        t = float(self.temperature)
        soft = optax.softmax_cross_entropy(
            logits.astype(work_dtype(logits.dtype)) / t, jax.nn.softmax(teacher / t)
        ).mean() * (t * t)
        loss = (1.0 - self.weight) * task_loss + self.weight * soft
        return loss, {**metrics, "loss": loss, "soft_loss": soft}

    def eval_inputs(self, batch):
        return self.task.eval_inputs(batch)

    def check_batch(self, batch) -> None:
        check = getattr(self.task, "check_batch", None)
        if check is not None:
            check(batch)

    def eval_sums(self, logits, batch):
        return self.task.eval_sums(logits, batch)

    def summarise(self, sums):
        return self.task.summarise(sums)

    def summarise_train(self, means):
        summarise = getattr(self.task, "summarise_train", None)
        return means if summarise is None else summarise(means)


def _perplexity(loss: float) -> float:
    """``exp(loss)`` (capped below float overflow); inf for a NaN loss (a diverged model), so that
    it ranks last wherever runs are compared (NaN compares as neither better nor worse)."""
    return math.inf if math.isnan(loss) else math.exp(min(loss, 700.0))


class LanguageModeling(NamedTuple):
    """Next-token prediction from ``{"tokens": [B, T + 1] int}``.

    Inputs are ``tokens[:, :-1]``, targets ``tokens[:, 1:]``.

    Metrics: mean cross-entropy per token (nats), perplexity, and bits per token.
    """

    def train_inputs(self, batch, key):
        del key
        return batch["tokens"][:, :-1], batch["tokens"][:, 1:]

    def loss(self, logits, targets, batch):
        """The mean token cross-entropy; metrics ``loss`` and ``token_loss`` (the same here; a
        :class:`Distillation` replaces ``loss`` by its mixed loss and keeps this one), from which
        :meth:`summarise_train` derives the interval's perplexity."""
        del batch
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        return loss, {"loss": loss, "token_loss": loss}

    @staticmethod
    def summarise_train(means):
        """A ``"train"`` record's metrics (means over the logging interval) with ``token_loss``
        replaced by the interval's ``perplexity``, ``exp`` of the mean token loss (a mean of
        per-step perplexities overstates it wherever the loss moves in the interval)."""
        means = dict(means)
        if "token_loss" in means:
            loss = means.pop("token_loss")
            means["perplexity"] = _perplexity(loss)
        return means

    def eval_inputs(self, batch):
        return batch["tokens"][:, :-1]

    def eval_sums(self, logits, batch):
        """Summed token cross-entropy and token count over the unmasked sequences."""
        m = _mask(batch, logits.shape[0])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
        return {"loss": (ce.sum(-1) * m).sum(), "count": m.sum() * ce.shape[1]}

    @staticmethod
    def summarise(sums):
        """``{"loss", "perplexity", "bits_per_token", "count"}`` from summed :meth:`eval_sums`; a
        NaN loss (a diverged model) has an infinite perplexity and bits per token, so that it ranks
        last wherever runs are compared (NaN compares as neither better nor worse)."""
        n = max(float(sums["count"]), 1.0)
        loss = float(sums["loss"]) / n
        worst = math.isnan(loss)
        return {
            "loss": loss,
            "perplexity": _perplexity(loss),
            "bits_per_token": math.inf if worst else loss / math.log(2),
            "count": int(sums["count"]),
        }
