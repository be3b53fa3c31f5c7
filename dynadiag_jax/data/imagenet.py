"""ImageNet-1k through ``tfds.data_source("imagenet2012")`` (array_record, no TensorFlow) and grain.

Prepare once (TensorFlow needed for that step only; docs/training.md, 'Preparing the data')::

    builder = tfds.builder("imagenet2012", data_dir=DATA_DIR, file_format="array_record")
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=TARS))

Training example number ``g`` (counted over the whole run) is image ``perm_e[g % N]`` of epoch
``e = g // N`` with ``perm_e = default_rng([seed, e]).permutation(N)``, augmented with
``default_rng([seed, g])``; step ``t`` holds examples ``t * B ... t * B + B - 1``, and each
process takes its contiguous share. Hence batches depend only on ``(seed, step)``: resuming needs
nothing but the step. Images leave the pipeline as uint8; the jitted step normalises them
(:class:`dynadiag_jax.training.Classification` with ``normalize=IMAGENET_MEAN_STD``).
Without the data, :class:`SyntheticImages` stands in for a split (random images and labels).
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import numpy as np

from dynadiag_jax._checks import int_at_least, int_in_range, no_directory
from dynadiag_jax.data.arrays import _process_share
from dynadiag_jax.data.augment import (
    RandAugment,
    check_crop_fraction,
    flip,
    random_resized_crop,
    resize_center_crop,
)

__all__ = [
    "IMAGENET_MEAN_STD",
    "ImageNetEval",
    "ImageNetTrain",
    "SyntheticImages",
    "check_imagenet_dir",
    "imagenet_source",
]

IMAGENET_MEAN_STD = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
DEIT_RANDAUGMENT = RandAugment()  # rand-m9-mstd0.5-inc1
DATASET = "imagenet2012"


# The versions tfds 4.9's imagenet2012 builder loads (its VERSION and SUPPORTED_VERSIONS), newest
# first; a preparation at another version is not read.
VERSIONS = ("5.1.0", "5.0.0")
PREPARE = (
    'tfds.builder("imagenet2012", data_dir=..., file_format="array_record")'
    ".download_and_prepare(...) on ILSVRC2012_img_{train,val}.tar "
    "(docs/training.md, 'Preparing the data')"
)


def check_imagenet_dir(data_dir) -> pathlib.Path:
    """The directory ``<data_dir>/imagenet2012/<version>`` that :func:`imagenet_source` loads: the
    newest of :data:`VERSIONS` prepared as array_record. Otherwise a one-line
    ``FileNotFoundError`` that says what to do."""
    if data_dir is None:
        raise FileNotFoundError(
            "ImageNet needs data_dir: the tfds data directory in which imagenet2012 was prepared "
            "(see docs/training.md, 'Preparing the data')"
        )
    root = pathlib.Path(data_dir).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"ImageNet data_dir {root} {no_directory(root)}")
    prepared = [root / DATASET / v for v in VERSIONS]
    prepared = [v for v in prepared if (v / "dataset_info.json").is_file()]
    if not prepared:
        raise FileNotFoundError(_not_prepared(root))
    for vdir in prepared:
        if any(vdir.glob("*.array_record-*")):
            return vdir
    # tfds's default file_format, tfrecord, has no random access: tfds.data_source refuses it.
    shards = prepared[0].glob(f"{DATASET}-*.*-of-*")
    formats = sorted({f.name.split(".")[1].split("-")[0] for f in shards})
    was = f"was prepared as {', '.join(formats)}" if formats else "holds no data files"
    raise FileNotFoundError(
        f'{prepared[0]} {was}: only a preparation with file_format="array_record" is read; '
        f"prepare it again with {PREPARE}"
    )


def _not_prepared(root: pathlib.Path) -> str:
    """Why ``root`` holds no :data:`VERSIONS` preparation, and what to do."""
    if DATASET in (root.name, root.parent.name):  # the data set's folder or a version in it
        tfds_root = root.parent if root.name == DATASET else root.parent.parent
        if any((tfds_root / DATASET).glob("*/dataset_info.json")):
            return (
                f"ImageNet data_dir {root} is inside the {DATASET} folder: give the tfds data "
                f"directory that holds that folder, data_dir={tfds_root}"
            )
    others = sorted(p.parent.name for p in (root / DATASET).glob("*/dataset_info.json"))
    if others:
        found = f" (only version {', '.join(others)}, which tfds does not read)"
    elif (root / "train").is_dir() or (root / "val").is_dir():
        found = " (an image-folder copy is not read)"
    else:
        found = ""
    return (
        f"{root} holds no prepared {DATASET} {' or '.join(VERSIONS)}{found}: prepare it with "
        f"{PREPARE}"
    )


def imagenet_source(split: str, data_dir, version: str | None = None):
    """Random-access source of ``{"image": uint8 [H, W, C], "label": int, "file_name": bytes}``
    examples (``C``: 3, or 4 for a CMYK JPEG that tfds decodes with PIL; the transforms return
    RGB whatever ``C``).

    ``version`` defaults to the one :func:`check_imagenet_dir` picks in ``data_dir`` (tfds alone
    would look for its newest, 5.1.0, only); with no ``data_dir``, tfds's default directory.
    """
    import tensorflow_datasets as tfds

    if version is None and data_dir is not None:
        version = check_imagenet_dir(data_dir).name
    name = DATASET if version is None else f"{DATASET}:{version}"
    return tfds.data_source(
        name,
        split=split,
        data_dir=None if data_dir is None else str(pathlib.Path(data_dir).expanduser()),
        download=False,
    )


def _reader_counts(num_threads: int, prefetch: int) -> tuple[int, int]:
    # grain refuses a negative count only in the reader, at the first batch, as a traceback.
    return int_at_least(num_threads, "num_threads", 0), int_at_least(prefetch, "prefetch", 0)


class SyntheticImages:
    """A stand-in for an ImageNet split when there is no data: ``num_examples`` random examples
    ``{"image": uint8 [256, 320, 3], "label": int in [0, num_classes)}``, example ``i`` drawn
    from ``default_rng([seed, i])`` (the same on every call and process). Random pixels and labels:
    the pipeline, the model and the step run as on ImageNet (try a command, time it), but nothing
    can be learned (the accuracy stays near chance)."""

    SHAPE = (256, 320, 3)  # an ImageNet-like photo: larger than the crops, not square

    def __init__(self, num_examples: int, *, seed: int, num_classes: int = 1000):
        self.num_examples = int_at_least(num_examples, "num_examples", 1)
        self.seed = int_at_least(seed, "seed", 0)  # numpy's generators take no negative seed
        self.num_classes = int_at_least(num_classes, "num_classes", 1)

    def __len__(self) -> int:
        return self.num_examples

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.num_examples:
            raise IndexError(f"example {index} of {self.num_examples}")
        rng = np.random.default_rng([self.seed, int(index)])
        image = rng.integers(0, 256, self.SHAPE, dtype=np.uint8)
        return {"image": image, "label": int(rng.integers(self.num_classes))}


def _read_options(num_threads: int, prefetch: int):
    import grain

    return grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)


class ImageNetTrain:
    """Augmented training batches ``{"image": uint8 [B, S, S, 3], "label": int32 [B]}`` by step.

    Args:
      source: a random-access source (:func:`imagenet_source`, or any sequence of examples); its
        images may have 1 to 4 channels (grey, CMYK, ...): all leave as RGB.
      global_batch_size: examples per step over all processes.
      seed: data order and augmentation seed.
      image_size: output side ``S``.
      randaugment: :class:`~dynadiag_jax.data.augment.RandAugment` or ``None``.
      num_threads, prefetch: grain's reader threads and prefetch buffer (examples).
    """

    def __init__(
        self,
        source,
        global_batch_size: int,
        *,
        seed: int,
        image_size: int = 224,
        randaugment: RandAugment | None = DEIT_RANDAUGMENT,
        num_threads: int = 16,
        prefetch: int = 512,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        self.source = source
        self.num_examples = len(source)
        self.global_batch_size = int_in_range(global_batch_size, "batch size", 1, self.num_examples)
        self.seed = int_at_least(seed, "seed", 0)  # numpy's generators take no negative seed
        self.image_size = int_at_least(image_size, "image_size", 1)
        self.randaugment = None if randaugment is None else randaugment.check()
        self.num_threads, self.prefetch = _reader_counts(num_threads, prefetch)
        self._share = _process_share(self.global_batch_size, process_index, process_count)
        self._perms: dict[int, np.ndarray] = {}

    def _permutation(self, epoch: int) -> np.ndarray:
        # Reader threads share this cache; a race only computes the same permutation twice.
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
            self._perms = {epoch: perm, **{e: p for e, p in self._perms.items() if e == epoch - 1}}
        return perm

    def example(self, g: int) -> dict:
        """Training example number ``g`` of the run, augmented."""
        epoch, i = divmod(int(g), self.num_examples)
        ex = self.source[int(self._permutation(epoch)[i])]
        rng = np.random.default_rng([self.seed, int(g)])
        image = random_resized_crop(np.asarray(ex["image"]), self.image_size, rng)
        image = flip(image, rng)
        if self.randaugment is not None:
            image = self.randaugment(image, rng)
        return {"image": image, "label": np.int32(ex["label"])}

    def iterate(self, start_step: int) -> Iterator[dict[str, np.ndarray]]:
        import grain

        b, share = self.global_batch_size, self._share
        local = share.stop - share.start

        def global_index(k):
            return (k // local) * b + share.start + k % local

        ds = (
            grain.MapDataset.range(int(start_step) * local, np.iinfo(np.int64).max // b)
            .map(lambda k: self.example(global_index(k)))
            .to_iter_dataset(_read_options(self.num_threads, self.prefetch))
            .batch(local, drop_remainder=True)
        )
        return iter(ds)


class ImageNetEval:
    """Every example of ``source`` once, resized and centre-cropped, in padded batches
    ``{"image": uint8 [B, S, S, 3], "label": int32 [B], "mask": float32 [B]}``."""

    def __init__(
        self,
        source,
        global_batch_size: int,
        *,
        image_size: int = 224,
        crop_fraction: float = 0.875,
        num_threads: int = 16,
        prefetch: int = 512,
        max_examples: int | None = None,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        self.source = source
        n = len(source)
        if not n:  # else the run trains and fails at its first evaluation
            raise ValueError("the evaluation source holds no example")
        if max_examples is not None:
            n = min(n, int_at_least(max_examples, "max_examples", 1))
        self.num_examples = n
        self.global_batch_size = int_at_least(global_batch_size, "batch size", 1)
        self.image_size = int_at_least(image_size, "image_size", 1)
        self.crop_fraction = check_crop_fraction(crop_fraction)
        self.num_threads, self.prefetch = _reader_counts(num_threads, prefetch)
        self._share = _process_share(self.global_batch_size, process_index, process_count)

    def example(self, g: int) -> dict:
        """Position ``g`` of the padded evaluation order: example ``g``, or example 0 with
        ``mask`` 0 past the end."""
        valid = g < self.num_examples
        ex = self.source[int(g) if valid else 0]
        image = resize_center_crop(
            np.asarray(ex["image"]), self.image_size, crop_fraction=self.crop_fraction
        )
        return {"image": image, "label": np.int32(ex["label"]), "mask": np.float32(valid)}

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        import grain

        b, share = self.global_batch_size, self._share
        local = share.stop - share.start
        num_batches = -(-self.num_examples // b)

        def global_index(k):
            return (k // local) * b + share.start + k % local

        ds = (
            grain.MapDataset.range(0, num_batches * local)
            .map(lambda k: self.example(global_index(k)))
            .to_iter_dataset(_read_options(self.num_threads, self.prefetch))
            .batch(local, drop_remainder=True)
        )
        return iter(ds)
