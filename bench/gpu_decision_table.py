"""What ``impl="auto"`` runs on a GPU, and why: the cost model's decision table.

For the linear layers of ViT-B/16 (batch 2048 x 197 tokens) and GPT-2 small (batch 256 x 1024
tokens), each sparsity and block size (b = 1: element diagonals, scattered), prints per device the
path ``impl="auto"`` takes (``kernel`` or ``dense`` = W built on the device + XLA's dot) and the
model's speed-up of the kernels over that dense path, forward / forward + backward. No GPU is
needed: these are the predictions of ``dynadiag_jax.gpu_cost`` (docs/gpu_cost_model.md), the same
numbers ``ops/auto.py`` decides from.

    python bench/gpu_decision_table.py                  # H100 and A100, bfloat16, markdown
    python bench/gpu_decision_table.py --devices H100 --dtype float32 --csv /tmp/table.csv
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import sys

import jax.numpy as jnp
from bench_cli import out_file  # bench/, beside this

import dynadiag_jax as dd
from dynadiag_jax import gpu_cost
from dynadiag_jax.ops import auto

MODELS = {
    "ViT-B/16": (2048 * 197, {"qkv": (768, 2304), "proj": (768, 768), "fc1": (768, 3072),
                              "fc2": (3072, 768)}),
    "GPT-2 small": (256 * 1024, {"c_attn": (768, 2304), "c_proj": (768, 768), "c_fc": (768, 3072),
                                 "mlp.c_proj": (3072, 768)}),
}  # fmt: skip
SPARSITIES = (0.5, 0.8, 0.9, 0.95, 0.98)
BLOCK_SIZES = (1, 16, 32, 64)


def rows_of_table(device: str, dtype):
    """One record per (model, layer, b, sparsity)."""
    spec = gpu_cost.DEVICES[device]
    for model, (rows, layers) in MODELS.items():
        for layer, (in_f, out_f) in layers.items():
            for b in BLOCK_SIZES:
                for s in SPARSITIES:
                    k = dd.num_diagonals(in_f, out_f, s, block_size=b)
                    d = auto.decide_for_gpu(rows, in_f, out_f, dtype, k, b, spec)
                    fwd, step = d.prediction.speedup("kernel", "dense")
                    yield {
                        "device": device,
                        "dtype": jnp.dtype(dtype).name,
                        "model": model,
                        "layer": f"{layer} {in_f}->{out_f}",
                        "rows": rows,
                        "block_size": b,
                        "sparsity": s,
                        "K": k,
                        "auto": "kernel" if d.impl == "ffi" else "dense",
                        "speedup_fwd": round(fwd, 2),
                        "speedup_step": round(step, 2),
                    }


def markdown(records) -> str:
    """A table per device: rows (model, layer, b), columns sparsity; cells path fwd/step."""
    out = []
    for device in dict.fromkeys(r["device"] for r in records):
        recs = [r for r in records if r["device"] == device]
        out.append(f"\n**{device}, {recs[0]['dtype']}** - path (kernel speed-up over the dense "
                   "path: forward / forward + backward)\n")  # fmt: skip
        out.append("| model | layer | b | " + " | ".join(f"{s:.0%}" for s in SPARSITIES) + " |")
        out.append("|---|---|---|" + "---|" * len(SPARSITIES))
        keys = dict.fromkeys((r["model"], r["layer"], r["block_size"]) for r in recs)
        for model, layer, b in keys:
            cells = []
            for s in SPARSITIES:
                (r,) = [
                    r
                    for r in recs
                    if (r["model"], r["layer"], r["block_size"], r["sparsity"])
                    == (model, layer, b, s)
                ]
                path = "**kernel**" if r["auto"] == "kernel" else "dense"
                cells.append(f"{path} {r['speedup_fwd']:.2f}/{r['speedup_step']:.2f}")
            out.append(f"| {model} | {layer} | {b} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def parse_devices(text: str) -> list[str]:
    """``"H100,A100"``: names of ``gpu_cost.DEVICES``."""
    names = list(dict.fromkeys(text.split(",")))  # a repeated device is timed once
    if not all(name in gpu_cost.DEVICES for name in names):
        raise argparse.ArgumentTypeError(
            f"devices must be among {', '.join(gpu_cost.DEVICES)}, comma separated; got {text!r}"
        )
    return names


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--devices",
        type=parse_devices,
        default="H100,A100",
        help=f"comma-separated, of {', '.join(gpu_cost.DEVICES)}",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument(
        "--csv", type=out_file, default=None, help="also write the records to this CSV file"
    )
    args = parser.parse_args(argv)
    records = [r for device in args.devices for r in rows_of_table(device, jnp.dtype(args.dtype))]
    print(markdown(records))
    if args.csv:
        pathlib.Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(records[0]))
            writer.writeheader()
            writer.writerows(records)
        print(f"\nwrote {args.csv}", file=sys.stderr)


if __name__ == "__main__":
    main()
