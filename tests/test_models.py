"""Models: shapes, published parameter counts, and which layers the dense argument replaces."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from training_helpers import fast_compile  # noqa: F401 - fixture

from dynadiag_jax import models

pytestmark = pytest.mark.usefixtures("fast_compile")

KEY = jax.random.key(0)
IMG = jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32)
TOKENS = jax.ShapeDtypeStruct((1, 1024), jnp.int32)

# Parameter counts of the reference implementations (timm / the Mixer paper / HF GPT-2).
PUBLISHED = [
    (functools.partial(models.ViT, 1000, "Ti/16"), IMG, 5_717_416),
    (functools.partial(models.ViT, 1000, "S/16"), IMG, 22_050_664),
    (functools.partial(models.ViT, 1000, "B/16"), IMG, 86_567_656),
    (functools.partial(models.MlpMixer, 1000, "S/16"), IMG, 18_528_264),
    (functools.partial(models.MlpMixer, 1000, "B/16"), IMG, 59_880_472),
    (functools.partial(models.GPT2, 50257, "small"), TOKENS, 124_439_808),
    (functools.partial(models.GPT2, 50257, "medium"), TOKENS, 354_823_168),
]


def _count(tree):
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize(
    "make, example, expected",
    PUBLISHED,
    ids=lambda v: getattr(v, "args", [""])[-1] if isinstance(v, functools.partial) else "",
)
def test_parameter_counts_match_reference_models(make, example, expected):
    assert _count(jax.eval_shape(make().init, KEY, example)["params"]) == expected


TINY = [
    (models.MLP(10, hidden=(8, 8)), jnp.ones((2, 28, 28, 1)), (2, 10)),
    (models.ViT(10, "mu/4", drop_path=0.1, dropout=0.1), jnp.ones((2, 16, 16, 3)), (2, 10)),
    (models.MlpMixer(10, "mu/4", drop_path=0.1), jnp.ones((2, 16, 16, 3)), (2, 10)),
    (
        models.GPT2(256, "mu", block_size=16, dropout=0.1),
        jnp.ones((2, 16), jnp.int32),
        (2, 16, 256),
    ),
]


@pytest.mark.parametrize("model, x, shape", TINY, ids=["mlp", "vit", "mixer", "gpt2"])
def test_forward_shapes_train_and_eval(model, x, shape):
    variables = jax.jit(model.init)(KEY, x)
    y_eval = jax.jit(model.apply)(variables, x)
    y_train = jax.jit(functools.partial(model.apply, train=True))(
        variables, x, rngs={"dropout": KEY}
    )
    assert y_eval.shape == y_train.shape == shape
    assert y_eval.dtype == jnp.float32
    assert np.isfinite(np.asarray(y_train)).all()


def test_gpt2_is_causal():
    model = models.GPT2(256, "mu", block_size=8)
    x = jnp.arange(8, dtype=jnp.int32)[None]
    variables = jax.jit(model.init)(KEY, x)
    apply = jax.jit(model.apply)
    y1, y2 = apply(variables, x), apply(variables, x.at[0, 5].set(99))
    np.testing.assert_allclose(y1[0, :5], y2[0, :5], rtol=1e-6, atol=1e-6)
    assert not np.allclose(y1[0, 5:], y2[0, 5:])


class Marked(nn.Dense):
    """A Dense that is recognisable by its class."""


EXPECTED_SPARSE = {
    "mlp": (
        models.MLP(10, hidden=(8, 8)),
        jnp.ones((1, 4, 4, 1)),
        models.mlp.SPARSE_LAYERS,
        ["hidden_0", "hidden_1"],
    ),
    "vit": (
        models.ViT(10, "mu/4"),
        jnp.ones((1, 8, 8, 3)),
        models.vit.SPARSE_LAYERS,
        [
            f"encoder/block_{i}/{m}"
            for i in range(2)
            for m in ("attn/proj", "attn/qkv", "mlp/fc1", "mlp/fc2")
        ],
    ),
    "mixer": (
        models.MlpMixer(10, "mu/4"),
        jnp.ones((1, 8, 8, 3)),
        models.mixer.SPARSE_LAYERS,
        [
            f"block_{i}/{m}/{f}"
            for i in range(2)
            for m in ("channel_mixing", "token_mixing")
            for f in ("fc1", "fc2")
        ],
    ),
    "gpt2": (
        models.GPT2(256, "mu", block_size=8),
        jnp.ones((1, 8), jnp.int32),
        models.gpt2.SPARSE_LAYERS,
        [
            f"block_{i}/{m}"
            for i in range(2)
            for m in ("attn/c_attn", "attn/c_proj", "mlp/c_fc", "mlp/c_proj")
        ],
    ),
}


@pytest.mark.parametrize("name", EXPECTED_SPARSE)
def test_default_patterns_select_the_authors_layers_and_never_heads(name):
    model, x, patterns, expected = EXPECTED_SPARSE[name]
    replaceable = models.replaceable_layers(model, x)  # heads and embeddings are never replaceable
    assert replaceable == sorted(expected)
    assert [
        p for p in replaceable if models.ByPath(patterns, sparse=Marked).matches(p)
    ] == replaceable
    assert models.unmatched_patterns(patterns, expected) == []
    assert models.unmatched_patterns((r".*/head",), expected) == [r".*/head"]


def test_by_path_calls_sparse_constructor_only_for_matching_paths():
    calls = []

    def spy(ctor):
        def make(features, **kwargs):
            calls.append((ctor.__name__, kwargs["name"]))
            return ctor(features, **kwargs)

        return make

    model = models.MLP(
        10,
        hidden=(8, 8, 8),
        dense=models.ByPath((r"hidden_[02]",), sparse=spy(Marked), dense=spy(nn.Dense)),
    )
    jax.eval_shape(model.init, KEY, jnp.ones((1, 4)))
    assert sorted(calls) == [("Dense", "hidden_1"), ("Marked", "hidden_0"), ("Marked", "hidden_2")]


def test_by_path_rejects_bad_patterns():
    with pytest.raises(TypeError, match="sequence of regular expressions"):
        models.ByPath("hidden_0", sparse=nn.Dense)
    with pytest.raises(ValueError, match="invalid layer pattern"):
        models.ByPath(("hidden_(",), sparse=nn.Dense)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: models.ViT(10, "X/16"), "unknown ViT size 'X'"),
        (lambda: models.ViT(10, "B16"), "size/patch"),
        (lambda: models.ViT(10, "B/zero"), "patch size"),
        (lambda: models.MlpMixer(10, "Q/16"), "known sizes: mu, C, S, B"),
        (lambda: models.GPT2(256, "huge"), "unknown GPT2 variant"),
        (lambda: models.MLP(10, hidden=()), "non-empty"),
    ],
)
def test_bad_variants_fail_at_construction(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: models.MLP(0), ValueError, "MLP: num_classes must be >= 1, got 0"),
        (lambda: models.MLP(3, hidden=(2.5,)), TypeError, r"MLP: hidden\[0\] must be an int"),
        (lambda: models.MLP(3, hidden=(8, 0)), ValueError, r"MLP: hidden\[1\] must be >= 1"),
        (lambda: models.MLP(3, hidden="8"), ValueError, "hidden must be a non-empty sequence"),
        (lambda: models.ViT(0, "mu/4"), ValueError, "ViT: num_classes must be >= 1"),
        (lambda: models.MlpMixer(-1, "mu/4"), ValueError, "MlpMixer: num_classes must be >= 1"),
        (lambda: models.GPT2(0, "mu"), ValueError, "GPT2: vocab_size must be >= 1"),
        (lambda: models.GPT2(256, "mu", block_size=0), ValueError, "GPT2: block_size must be"),
        # a rate of 1.5 zeroed every activation in training, -0.5 scaled them by 2/3
        (lambda: models.GPT2(256, "mu", dropout=1.5), ValueError, r"GPT2: dropout must be in"),
        (lambda: models.GPT2(256, "mu", dropout=-0.5), ValueError, r"GPT2: dropout must be in"),
        (lambda: models.ViT(10, "mu/4", dropout=1.0), ValueError, r"ViT: dropout must be in"),
        (lambda: models.MlpMixer(10, "mu/4", drop_path=2), ValueError, r"drop_path must be in"),
        (lambda: models.ByPath(("h",), sparse=None), TypeError, "ByPath.sparse must be a layer"),
        (lambda: models.ByPath(("h",), nn.Dense, dense=3), TypeError, "ByPath.dense must be a"),
    ],
)
def test_bad_sizes_and_constructors_fail_at_construction_by_name(make, error, match):
    """MLP truncated 2.5 to 2 and divided by zero at 0 classes; GPT2(0) failed in jnp.take; a
    ByPath without a sparse constructor blamed its dense one."""
    with pytest.raises(error, match=match):
        make()


def test_keywords_a_constructor_binds_are_kept():
    """The models passed use_bias=True and dtype=None to every replaceable layer, overriding
    what a functools.partial bound: a bias came back and bfloat16 fell back to float32."""
    import dynadiag_jax as dd

    x = jnp.ones((2, 16))
    for ctor in (nn.Dense, functools.partial(dd.nn.DiagonalDense, sparsity=0.5)):
        model = models.MLP(
            10, hidden=(16,), dense=functools.partial(ctor, use_bias=False, dtype=jnp.bfloat16)
        )
        with jax.numpy_dtype_promotion("standard"):  # the float32 head takes the bf16 output
            variables = model.init(KEY, x)
            _, inter = model.apply(variables, x, capture_intermediates=True)
        assert "bias" not in variables["params"]["hidden_0"]
        assert inter["intermediates"]["hidden_0"]["__call__"][0].dtype == jnp.bfloat16
    # the model's own dtype still reaches a constructor that binds none
    variables = models.MLP(10, hidden=(16,), dtype=jnp.bfloat16).init(KEY, x)
    _, inter = models.MLP(10, hidden=(16,), dtype=jnp.bfloat16).apply(
        variables, x, capture_intermediates=True
    )
    assert inter["intermediates"]["hidden_0"]["__call__"][0].dtype == jnp.bfloat16


def test_by_path_matches_the_same_layers_when_the_model_is_nested():
    """Patterns were matched against the absolute module path: inside a wrapper module every
    anchored pattern (the MLP's SPARSE_LAYERS, the paths replaceable_layers lists) matched
    nothing, and the model stayed dense without a word."""
    import dynadiag_jax as dd

    sparse = functools.partial(dd.nn.DiagonalDense, sparsity=0.5)
    x = jnp.ones((1, 8, 8, 3))
    qkv = "encoder/block_0/attn/qkv"
    assert qkv in models.replaceable_layers(models.ViT(10, "mu/4"), x)
    for make, patterns in (
        (functools.partial(models.ViT, 10, "mu/4"), (qkv,)),
        (functools.partial(models.MLP, 10, hidden=(16,)), models.mlp.SPARSE_LAYERS),
    ):

        class Wrapper(nn.Module):
            inner: nn.Module

            def __call__(self, x):
                return self.inner(x)

        inner = make(dense=models.ByPath(patterns, sparse=sparse))
        alone = jax.eval_shape(inner.init, KEY, x)["params"]
        nested = jax.eval_shape(Wrapper(inner).init, KEY, x)["params"]["inner"]
        assert jax.tree.structure(alone) == jax.tree.structure(nested)
        paths = ["/".join(map(str, p)) for p, _ in jax.tree.leaves_with_path(nested)]
        assert sum("alpha" in p for p in paths) == 1


def test_bad_input_shapes_name_the_expectation():
    with pytest.raises(ValueError, match="divisible by 4"):
        models.ViT(10, "mu/4").init(KEY, jnp.ones((1, 10, 10, 3)))
    with pytest.raises(ValueError, match="block_size=8"):
        models.GPT2(256, "mu", block_size=8).init(KEY, jnp.ones((1, 9), jnp.int32))
    with pytest.raises(TypeError, match="integers"):
        models.GPT2(256, "mu", block_size=8).init(KEY, jnp.ones((1, 8), jnp.float32))
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        models.MLP(10, hidden=(8,)).init(KEY, jnp.ones((784,)))  # once 784 examples of width 1


def test_gpt2_token_ids_out_of_range():
    """Ids >= vocab_size gave NaN logits silently, negative ones the embedding of vocab + id."""
    model = models.GPT2(256, "mu", block_size=8)
    tokens = jnp.arange(8, dtype=jnp.int32)[None]
    variables = model.init(KEY, tokens)
    for bad in (256, -1):
        with pytest.raises(ValueError, match=r"token ids must lie in \[0, vocab_size=256\)"):
            model.apply(variables, tokens.at[0, 3].set(bad))
        logits = jax.jit(model.apply)(variables, tokens.at[0, 3].set(bad))
        assert np.isnan(logits).all()
    assert np.isfinite(jax.jit(model.apply)(variables, tokens)).all()
    # a concrete array captured by a traced function is read on the host, not traced
    jax.eval_shape(lambda: model.init(KEY, tokens))
    bad = tokens.at[0, 3].set(256)
    with pytest.raises(ValueError, match="token ids must lie in"):
        jax.eval_shape(lambda: model.init(KEY, bad))


def test_by_path_builds_block_diagonal_layers():
    import dynadiag_jax as dd

    x = jnp.ones((2, 8, 8, 3))

    def vit(block_size):
        sparse = functools.partial(dd.nn.DiagonalDense, sparsity=0.8, block_size=block_size)
        return models.ViT(10, "mu/4", dense=models.ByPath(models.vit.SPARSE_LAYERS, sparse=sparse))

    model = vit(8)
    variables = jax.jit(model.init)(KEY, x)
    qkv = variables["params"]["encoder"]["block_0"]["attn"]["qkv"]
    assert qkv["values"].shape == (4, 12, 8, 8) and qkv["alpha"].shape == (4,)  # 32 -> 96
    frozen = dd.freeze_tree(variables)
    k = dd.num_diagonals(32, 96, 0.8, block_size=8)
    assert frozen["params"]["encoder"]["block_0"]["attn"]["qkv"]["values"].shape == (k, 12, 8, 8)
    assert jax.jit(model.apply)(frozen, x).shape == (2, 10)
    with pytest.raises(ValueError, match=r"encoder/block_0/attn/qkv: block_size=64 must divide"):
        vit(64).init(KEY, x)
