"""T.Distillation: a task (classification, or language modelling) whose loss mixes in a teacher's
softened predictions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dynadiag_jax import training as T


def _batch(n=6, classes=5, key=0):
    k1, k2 = jax.random.split(jax.random.key(key))
    return {
        "image": jax.random.normal(k1, (n, 3)),
        "label": jax.random.randint(k2, (n,), 0, classes),
    }


def _teacher(inputs):
    """A fixed linear teacher over the 3 input features, 5 classes."""
    w = jnp.arange(15, dtype=jnp.float32).reshape(3, 5) / 7.0 - 1.0
    return inputs @ w


@pytest.mark.parametrize("weight", [0.0, 0.3, 1.0])
def test_the_loss_mixes_the_task_loss_and_the_softened_cross_entropy(weight):
    task = T.Classification(5, label_smoothing=0.1)
    distill = T.Distillation(task, _teacher, weight=weight, temperature=3.0)
    batch = _batch()
    inputs, (hard, teacher) = distill.train_inputs(batch, jax.random.key(1))
    np.testing.assert_allclose(teacher, _teacher(batch["image"]), rtol=1e-6)
    logits = jax.random.normal(jax.random.key(2), (6, 5))
    loss, metrics = distill.loss(logits, (hard, teacher), batch)
    task_loss, task_metrics = task.loss(logits, hard, batch)
    p = jax.nn.softmax(teacher / 3.0)
    soft = -jnp.mean(jnp.sum(p * jax.nn.log_softmax(logits / 3.0), axis=-1)) * 9.0
    np.testing.assert_allclose(loss, (1 - weight) * task_loss + weight * soft, rtol=1e-5)
    np.testing.assert_allclose(metrics["soft_loss"], soft, rtol=1e-5)
    assert metrics["accuracy"] == task_metrics["accuracy"]


def test_language_modelling_distils_every_position():
    """Tokens in, [B, T, V] logits: the soft term is the mean over the examples and positions."""
    embed = jnp.arange(24, dtype=jnp.float32).reshape(8, 3) / 10.0 - 1.0

    def teacher(tokens):  # [B, T] -> [B, T, 8]
        return embed[tokens] @ embed.T

    task = T.LanguageModeling()
    distill = T.Distillation(task, teacher, weight=0.7, temperature=2.0)
    batch = {"tokens": jax.random.randint(jax.random.key(0), (4, 6), 0, 8)}
    inputs, (hard, t) = distill.train_inputs(batch, jax.random.key(1))
    assert inputs.shape == (4, 5) and t.shape == (4, 5, 8)
    logits = jax.random.normal(jax.random.key(2), (4, 5, 8))
    loss, metrics = distill.loss(logits, (hard, t), batch)
    task_loss, _ = task.loss(logits, hard, batch)
    p = jax.nn.softmax(t / 2.0)
    soft = -jnp.mean(jnp.sum(p * jax.nn.log_softmax(logits / 2.0), axis=-1)) * 4.0
    np.testing.assert_allclose(loss, 0.3 * task_loss + 0.7 * soft, rtol=1e-5)
    # the task's own loss stays beside the mixed one: the record's perplexity is of it
    np.testing.assert_allclose(metrics["token_loss"], task_loss, rtol=1e-6)
    record = distill.summarise_train({k: float(v) for k, v in metrics.items()})
    np.testing.assert_allclose(record["perplexity"], np.exp(task_loss), rtol=1e-5)


def test_a_student_equal_to_its_teacher_gets_no_gradient_from_the_soft_term():
    distill = T.Distillation(T.Classification(5), _teacher, weight=1.0, temperature=2.0)
    batch = _batch()
    _, targets = distill.train_inputs(batch, jax.random.key(0))
    grad = jax.grad(lambda s: distill.loss(s, targets, batch)[0])(_teacher(batch["image"]))
    np.testing.assert_allclose(grad, 0.0, atol=1e-6)
    # and the teacher gets none: its logits are constants of the loss
    grad_t = jax.grad(lambda x: distill.train_inputs({**batch, "image": x}, None)[1][1].sum())(
        batch["image"]
    )
    np.testing.assert_array_equal(grad_t, 0.0)


def test_a_float64_student_is_distilled_in_float64():
    """The soft term computes in the logits' precision, float32 at least (it cast to float32)."""
    with jax.enable_x64(True):
        w = jnp.asarray(np.random.default_rng(3).normal(size=(3, 5)))

        def teacher(inputs):
            return inputs @ w

        distill = T.Distillation(T.Classification(5), teacher, weight=1.0, temperature=2.0)
        batch = {**_batch(), "image": jnp.asarray(np.random.default_rng(0).normal(size=(6, 3)))}
        _, targets = distill.train_inputs(batch, None)
        assert targets[1].dtype == jnp.float64
        logits = jnp.asarray(np.random.default_rng(1).normal(size=(6, 5)))
        loss = lambda s: distill.loss(s, targets, batch)[0]  # noqa: E731
        assert loss(logits).dtype == jnp.float64
        t, eps = jnp.asarray(np.random.default_rng(2).normal(size=(6, 5))), 1e-6
        fd = (loss(logits + eps * t) - loss(logits - eps * t)) / (2 * eps)
        np.testing.assert_allclose(jnp.vdot(jax.grad(loss)(logits), t), fd, rtol=1e-8)


def test_evaluation_is_the_task_s():
    task = T.Classification(5)
    distill = T.Distillation(task, _teacher)
    batch = {**_batch(), "mask": jnp.array([1, 1, 1, 1, 0, 0])}
    logits = jax.random.normal(jax.random.key(3), (6, 5))
    np.testing.assert_array_equal(distill.eval_inputs(batch), task.eval_inputs(batch))
    sums = distill.eval_sums(logits, batch)
    assert jax.tree.all(
        jax.tree.map(lambda a, b: bool(a == b), sums, task.eval_sums(logits, batch))
    )
    assert distill.summarise(sums) == task.summarise(sums)


@pytest.mark.parametrize(
    "weight, temperature, match",
    [(-0.1, 2.0, "weight must be in"), (1.5, 2.0, "weight must be in"), (0.5, 0.0, "temperature")],
)
def test_bad_weights_and_temperatures_are_refused(weight, temperature, match):
    with pytest.raises(ValueError, match=match):
        T.Distillation(T.Classification(5), _teacher, weight=weight, temperature=temperature)
