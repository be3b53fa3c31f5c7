"""How many training images per second the ImageNet input pipeline delivers on this host.

``train/imagenet.py`` feeds its steps from :class:`dynadiag_jax.data.ImageNetTrain` (grain reader
threads: decode, random resized crop, flip, RandAugment). A run whose steps wait for their
batches logs it (``input_wait_fraction``); this measures the pipeline alone, for every
``--threads`` count, so that ``data.num_threads`` can be chosen before a long run: the images
per second it reaches against those the accelerators consume (``examples_per_s`` of a run).

The source is ``--data_dir``'s prepared ImageNet (tfds, array_record; docs/training.md), or,
without it, JPEGs made here (``--images`` distinct ones of ``--size``, smooth content plus noise,
about 100 KB each at 500x375), decoded on every read as tfds's decoder does. Each thread count
builds a fresh pipeline, takes ``--warmup`` batches untimed (threads starting, buffers filling)
and times ``--batches``; the counts run in ``--rounds`` interleaved rounds and each count's
rate is the median of its rounds. Prints a table and writes a CSV (``--out``, default
``bench/results/input_pipeline_<time>.csv``).

Example::

    python bench/input_pipeline.py --threads 1,2,4 --batch 64 --batches 4
    python bench/input_pipeline.py --data_dir /data/tfds --threads 8,16,32 --batch 256
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import numpy as np
from bench_cli import (  # bench/, beside this
    count,
    make_parser,
    out_file,
    parse_sizes,
    results_path,
    write_csv,
)


class SyntheticJpegs:
    """``num_examples`` examples ``{"image": uint8 [H, W, 3], "label": int}`` decoded from
    ``images`` distinct JPEGs of ``size = (W, H)`` on every read, as tfds's decoder returns
    ImageNet's."""

    def __init__(self, num_examples: int, images: int, size: tuple[int, int], seed: int = 0):
        from PIL import Image  # noqa: PLC0415 - the CLI's checks run without it

        rng = np.random.default_rng(seed)
        w, h = size
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        self.jpegs = []
        for i in range(images):
            # smooth content plus noise: JPEG sizes near a photo's (random pixels are 3x larger)
            f = rng.uniform(10, 40, 3)
            base = np.stack(
                [np.sin(xx / f[0] + i), np.cos(yy / f[1] - i), np.sin((xx + yy) / f[2])], -1
            )
            pixels = np.clip(128 + 100 * base + rng.normal(0, 20, (h, w, 3)), 0, 255)
            buf = io.BytesIO()
            Image.fromarray(pixels.astype(np.uint8)).save(buf, "JPEG", quality=90)
            self.jpegs.append(buf.getvalue())
        self.num_examples = num_examples

    def __len__(self) -> int:
        return self.num_examples

    def __getitem__(self, index: int) -> dict:
        from PIL import Image  # noqa: PLC0415

        data = self.jpegs[index % len(self.jpegs)]
        image = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        return {"image": image, "label": index % 1000}


def _source(args):
    from dynadiag_jax import data as D  # noqa: PLC0415

    if args.data_dir:
        return D.imagenet_source("train", args.data_dir), "imagenet2012 train"
    w, h = args.size
    return (
        SyntheticJpegs(1_000_000, args.images, args.size, seed=args.seed),
        f"{args.images} synthetic {w}x{h} JPEGs",
    )


def images_per_second(source, args, threads: int) -> float:
    """Training images per second of a fresh pipeline with ``threads`` reader threads."""
    from dynadiag_jax import data as D  # noqa: PLC0415

    pipeline = D.ImageNetTrain(
        source,
        args.batch,
        seed=args.seed,
        image_size=args.image_size,
        randaugment=D.RandAugment() if args.randaugment else None,
        num_threads=threads,
        prefetch=max(args.batch, 2 * threads),
        process_index=0,
        process_count=1,
    )
    batches = pipeline.iterate(0)
    for _ in range(args.warmup):
        next(batches)
    begin = time.perf_counter()
    for _ in range(args.batches):
        next(batches)
    return args.batch * args.batches / (time.perf_counter() - begin)


def parse_size(text: str) -> tuple[int, int]:
    """``"500x375"`` -> ``(500, 375)``."""
    try:
        w, h = (int(n) for n in text.lower().split("x"))
    except ValueError:
        w = h = 0
    if min(w, h) < 1:
        raise argparse.ArgumentTypeError(f"--size must look like 500x375; got {text!r}")
    return w, h


def main(argv=None) -> None:
    parser = make_parser(__doc__)
    parser.add_argument(
        "--threads",
        type=parse_sizes("thread counts", "1,2,4"),
        default=(1, 2),
        help="reader thread counts, comma separated (default 1,2)",
    )
    parser.add_argument("--batch", type=count("--batch"), default=64, help="images per batch")
    parser.add_argument(
        "--batches", type=count("--batches"), default=4, help="timed batches per round"
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed batches first, per round (default 1)"
    )
    parser.add_argument(
        "--rounds", type=count("--rounds"), default=3, help="interleaved rounds (default 3)"
    )
    parser.add_argument("--image_size", type=count("--image_size"), default=224)
    parser.add_argument(
        "--randaugment",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="DeiT's RandAugment, as train/imagenet.py's default (default on)",
    )
    parser.add_argument("--data_dir", default=None, help="a tfds data directory with imagenet2012")
    parser.add_argument(
        "--images", type=count("--images"), default=32, help="distinct synthetic JPEGs"
    )
    parser.add_argument(
        "--size", type=parse_size, default=(500, 375), help="synthetic JPEG size WxH"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=out_file, default=None, help="CSV path")
    args = parser.parse_args(argv)
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0; got {args.warmup}")
    out = args.out or results_path("input_pipeline")
    source, name = _source(args)
    print(
        f"{name}: {args.batch}-image batches of {args.image_size}x{args.image_size}, "
        f"RandAugment {'on' if args.randaugment else 'off'}; median of {args.rounds} rounds of "
        f"{args.batches} batches"
    )
    rates = {t: [] for t in args.threads}
    for r in range(args.rounds):
        order = args.threads[r % len(args.threads) :] + args.threads[: r % len(args.threads)]
        for threads in order:
            rates[threads].append(images_per_second(source, args, threads))
    rows = []
    for threads in args.threads:
        rate = statistics.median(rates[threads])
        rows.append(
            dict(
                threads=threads,
                images_per_s=round(rate, 1),
                per_thread=round(rate / threads, 1),
                ms_per_image_thread=round(1e3 * threads / rate, 3),
            )
        )
    print(f"{'threads':>8} {'images/s':>10} {'per thread':>11} {'ms/image/thread':>16}")
    for row in rows:
        print(
            f"{row['threads']:>8} {row['images_per_s']:>10.1f} {row['per_thread']:>11.1f} "
            f"{row['ms_per_image_thread']:>16.3f}"
        )
    write_csv(rows, list(rows[0]), "input_pipeline", out)


if __name__ == "__main__":
    main()
