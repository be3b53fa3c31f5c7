"""Data for the training scripts: small offline image sets, byte-level text, ImageNet via grain.

Every training source yields batches as a pure function of ``(seed, step)`` (see
:class:`ArrayBatches`), so checkpointed runs resume on exactly the right batch.
"""

from dynadiag_jax import _train_extra

_train_extra.require(__name__, ("PIL", "grain", "mlxtend", "tensorflow_datasets"))

from dynadiag_jax.data.arrays import ArrayBatches, EvalBatches
from dynadiag_jax.data.augment import RandAugment, flip, random_resized_crop, resize_center_crop
from dynadiag_jax.data.imagenet import (
    IMAGENET_MEAN_STD,
    ImageNetEval,
    ImageNetTrain,
    SyntheticImages,
    check_imagenet_dir,
    imagenet_source,
)
from dynadiag_jax.data.mnist import (
    ImageData,
    load_fashion_mnist,
    load_mnist5k,
    load_small_images,
    read_idx,
)
from dynadiag_jax.data.text import (
    BYTE_VOCAB_SIZE,
    Corpus,
    TokenWindows,
    WindowEvalBatches,
    decode_bytes,
    encode_bytes,
    load_corpus,
)

__all__ = [
    "ArrayBatches",
    "BYTE_VOCAB_SIZE",
    "Corpus",
    "EvalBatches",
    "IMAGENET_MEAN_STD",
    "ImageData",
    "ImageNetEval",
    "ImageNetTrain",
    "RandAugment",
    "SyntheticImages",
    "TokenWindows",
    "WindowEvalBatches",
    "check_imagenet_dir",
    "decode_bytes",
    "encode_bytes",
    "flip",
    "imagenet_source",
    "load_corpus",
    "load_fashion_mnist",
    "load_mnist5k",
    "load_small_images",
    "random_resized_crop",
    "read_idx",
    "resize_center_crop",
]
