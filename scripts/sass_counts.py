"""Instruction counts of the compiled CUDA kernels, for the cost model's issue and occupancy terms.

Compiles ``xla_ext/cuda/ffi_handlers.cu`` (the source the CUDA extension ships) for sm_90 with line
information, disassembles it with ``nvdisasm -gi`` and reads ``ptxas -v``. Every SASS instruction
of a kernel is attributed to the innermost line of ``xla_ext/cuda`` it was compiled from (inlined
wmma and intrinsic code counts for the kernel line that called it) and falls in one *region* of
:data:`REGIONS`, a span of source lines with a *unit* instruction:

* ``HMMA``: per warp-level ``m16n16k16`` product (two ``HMMA.16816`` on sm_90);
* ``FFMA``: per float32 FMA instruction (32 thread-level FMAs);
* ``LDG`` / ``STG``: per global load / store instruction (32 elements, one per lane);
* ``trip``: per trip of the loop whose back edge comes from the region's loop line (the
  instructions of that loop's body that no other region claims);
* ``cta``: everything else, once per warp of every thread block (an upper bound: both sides of
  every branch are counted).

A region's figure is its instruction count divided by its unit count, so unrolled copies that a
thread block skips (fragments past the panel, weight slots past the blocks in use) cost nothing:
the model multiplies each figure by the units the launch plan executes (``gpu_cost.py``).

    python scripts/sass_counts.py              # print the counts (needs nvcc and nvdisasm)
    python scripts/sass_counts.py --write      # regenerate dynadiag_jax/gpu_sass.py

``nvdisasm`` comes with the CUDA toolkit or ``pip install nvidia-cuda-nvdisasm`` (its ``bin`` folder
is found without PATH). tests/test_gpu_sass.py regenerates the table when both tools are present
and requires it equal to the recorded one for the recorded nvcc version.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter

ROOT = pathlib.Path(__file__).resolve().parent.parent
CUDA_DIR = ROOT / "xla_ext" / "cuda"
SOURCE = CUDA_DIR / "ffi_handlers.cu"
TABLE = ROOT / "dynadiag_jax" / "gpu_sass.py"
ARCH = "90"
HMMA_PER_MMA = 2  # wmma m16n16k16 = two mma.sync m16n8k16 on sm_80/sm_90

# Region spans: (file, function signature text, first line text, last line text); the first line
# is searched after the signature, the last after the first (a single line when equal).
B, E = "block_kernels.cuh", "diag_kernels.cuh"
KERNEL_FILES = ("/xla_ext/cuda/" + B, "/xla_ext/cuda/" + E)
FETCH = "fetch_block_slice(const BlockProductArgs"
X_FETCH = (B, FETCH, "for (int e = 0; e < kPer; ++e) {", "if (ok) tally.load(sizeof(T));")
W_FETCH = (B, FETCH, "const int per_use = a.b * width;", "tally.load(sizeof(T));")
W_SLOT = (B, "int weight_slot(int n", "if (!kTranspose) return n;", "return u * per_use")
OUT_COL = (B, "block_out_col(const BlockProductArgs", "if (!kOutLong)", "return (int64_t(p.s)")
SDDMM_FETCH = (B, "fetch_sddmm_stage(const BlockSddmmArgs", "for (int e = 0;", "tally.load(")
SDDMM_COMMIT = (B, "commit_sddmm_stage(Dst dst", "for (int e = 0;", "dst[n] = regs[e];")
SDDMM_STORE = (B, "store_sddmm(const BlockSddmmArgs", "const int jd = blk", "tally.store(4);")
TC = "block_product_tc_kernel(BlockProductArgs"
SIMT = "block_product_simt_kernel(BlockProductArgs"
SDDMM_TC = "block_sddmm_tc_kernel(BlockSddmmArgs"
SDDMM_SIMT = "block_sddmm_simt_kernel(BlockSddmmArgs"
ETC = "element_tensor_core_tile(const ProductArgs"
EDIAG = "element_diagonal_tile(const ProductArgs"

# kernel template -> {region: (unit, [spans])}; "stage" regions name their loop's first line.
REGIONS = {
    "block_product_tc_kernel": {
        "mma": ("HMMA", [(B, TC, "wmma::fragment<wmma::matrix_a", "tally.mma(S::kRowFrags);")]),
        "store": ("STG", [(B, TC, "const int64_t col0 =", "__syncwarp();  // this warp's tile")]),
        "stage": ("trip", [(B, TC, "for (int i = 0; i < n_slices; ++i) {", "")]),
    },
    "block_product_simt_kernel": {
        "fma": ("FFMA", [(B, SIMT, "for (int kk = 0; kk < width; ++kk) {",
                          "tally.fma(int64_t(rpt) * width);")]),
        "x_load": ("LDG", [X_FETCH, (B, SIMT, "for (int e = 0; e < kPer; ++e) xs[", "")]),
        "w_load": ("LDG", [W_FETCH, W_SLOT, (B, SIMT, "const int n = tid + e * kBlockThreads;",
                                             "if (n < cols * width)")]),
        "store": ("STG", [OUT_COL, (B, SIMT, "const int64_t col = block_out_col",
                                    "tally.store(sizeof(T));")]),
        "stage": ("trip", [(B, SIMT, "for (int i = 0; i < n_slices; ++i) {", "")]),
    },
    "block_sddmm_tc_kernel": {
        "mma": ("HMMA", [(B, SDDMM_TC, "if (desc[m] < 0) continue;", "tally.mma(1);")]),
        "load": ("LDG", [(B, SDDMM_TC, "auto issue = [&]", "src[e] += from_dy[e]")]),
        "store": ("STG", [(B, SDDMM_TC, "wmma::store_matrix_sync(cs, acc[m]",
                                        "tally.flush(kCountBlockSddmm);")]),
        "stage": ("trip", [(B, SDDMM_TC, "for (int st = 0; st < n_stages; ++st) {", "")]),
    },
    "block_sddmm_simt_kernel": {
        "fma": ("FFMA", [(B, SDDMM_SIMT, "const int e = tid + m * kBlockThreads;",
                          "tally.fma(kBlockSddmmStageRows);")]),
        "load": ("LDG", [SDDMM_FETCH, SDDMM_COMMIT]),
        "store": ("STG", [SDDMM_STORE, (B, SDDMM_SIMT, "if (e < n_elems) store_sddmm", "")]),
        "stage": ("trip", [(B, SDDMM_SIMT, "for (int st = 0; st < n_stages; ++st) {", "")]),
    },
    "element_product_kernel": {
        "mma": ("HMMA", [(E, ETC, "wmma::fragment<wmma::matrix_a", "tally.mma(1);")]),
        "x_load": ("LDG", [(E, ETC, "for (int s = 0; s < kPerThread; ++s) {",
                            "if (ok) tally.load(sizeof(T));"),
                           (E, ETC, "for (int s = 0; s < kPerThread; ++s) xs[", "")]),
        "tc_store": ("STG", [(E, ETC, "wmma::store_matrix_sync(cs[warp]", "tally.store(")]),
        "stage": ("trip", [(E, ETC, "for (int st = 0; st < n_stages; ++st) {", "")]),
        "fma": ("FFMA", [(E, EDIAG, "for (int j = 0; j < cnt; ++j) {", "tally.fma(nr);")]),
        "diag_store": ("STG", [(E, EDIAG, "for (int i = 0; i < kElemRowsPerThread; ++i) {  //",
                                "tally.store(")]),
    },
    "element_plan_kernel": {},
    "sddmm_kernel": {
        "fma": ("FFMA", [(E, "sddmm_kernel(SddmmArgs", "for (int64_t r = r0 + warp;",
                          "tally.fma(n_use);")]),
    },
    "sddmm_reduce_kernel": {
        "load": ("LDG", [(E, "sddmm_reduce_kernel(ReduceArgs", "for (int z = 0;", "")]),
    },
}  # fmt: skip

DTYPES = {"6__half": "float16", "13__nv_bfloat16": "bfloat16", "f": "float32"}


def find_tool(name: str) -> str | None:
    """``name`` on PATH, else in the bin folder of the ``nvidia-cuda-*`` wheels."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import nvidia  # noqa: PLC0415 - namespace package of the NVIDIA wheels, optional
    except ImportError:
        return None
    for base in nvidia.__path__:
        for path in pathlib.Path(base).glob(f"*/bin/{name}"):
            return str(path)
    return None


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    return re.search(r"release [\d.]+, V([\d.]+)", out).group(1)


def compile_device_code(nvcc: str, include_dir: str, out_dir, archs=(ARCH,)) -> str:
    """Compile the shipped source's device code for ``archs`` in one nvcc call; returns the
    ``ptxas -v`` log. ``out_dir`` keeps each architecture's ``ffi_handlers.compute_<a>.cubin``
    and ``.ptx`` (:func:`cubin_path`), so one build serves every check that reads them."""
    out = pathlib.Path(out_dir)
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    cmd = [nvcc, "--fatbin", "-std=c++17", "-O3", "-DNDEBUG", "-lineinfo", "-Xptxas", "-v",
           "--threads", "0", "--keep", "--keep-dir", str(out), *gencode,
           "-I", str(ROOT / "xla_ext"), "-isystem", include_dir,
           str(SOURCE), "-o", str(out / "kernels.fatbin")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed:\n{proc.stderr[-4000:]}")
    return proc.stdout + proc.stderr


def cubin_path(out_dir, arch: str = ARCH) -> pathlib.Path:
    """The cubin of ``arch`` that :func:`compile_device_code` or the CMake build (which embeds PTX
    as well, ``<stem>.compute_<a>.sm_<a>.cubin``) kept in ``out_dir``; nvcc leaves the
    architecture out of the name when it compiles for one."""
    out = pathlib.Path(out_dir)
    for name in (f"compute_{arch}.cubin", f"compute_{arch}.sm_{arch}.cubin"):
        if (out / f"{SOURCE.stem}.{name}").exists():
            return out / f"{SOURCE.stem}.{name}"
    return out / f"{SOURCE.stem}.cubin"


def disassemble(nvdisasm: str, cubin) -> str:
    """``nvdisasm -c -gi`` text of a cubin."""
    dis = subprocess.run([nvdisasm, "-c", "-gi", str(cubin)], capture_output=True, text=True)
    if dis.returncode != 0:
        raise RuntimeError(f"nvdisasm failed:\n{dis.stderr[-4000:]}")
    return dis.stdout


def compile_and_disassemble(nvcc: str, nvdisasm: str, include_dir: str) -> tuple[str, str]:
    """(ptxas -v log, nvdisasm -gi text) of the sm_90 build of the shipped source."""
    with tempfile.TemporaryDirectory() as tmp:
        log = compile_device_code(nvcc, include_dir, tmp)
        return log, disassemble(nvdisasm, cubin_path(tmp))


def resources(log: str, arch: str = ARCH) -> dict:
    """Mangled kernel -> (registers, static shared memory bytes) of ``arch`` from ``ptxas -v``."""
    out, current = {}, None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\S+)' for 'sm_(\d+)'", line):
            current = m.group(1) if m.group(2) == arch else None
        elif current and (m := re.search(r"Used (\d+) registers", line)):
            smem = re.search(r"(\d+) bytes smem", line)
            out[current] = (int(m.group(1)), int(smem.group(1)) if smem else 0)
    return out


class Instruction:
    __slots__ = ("text", "file", "line")

    def __init__(self, text, file, line):
        self.text, self.file, self.line = text, file, line


def sass_functions(text: str) -> dict:
    """Mangled kernel -> (instructions, {label: index}) from ``nvdisasm -c -gi`` output."""
    funcs, name, insts, labels, where, expect = {}, None, [], {}, (None, 0), None
    for raw in text.splitlines():
        if m := re.match(r"^\.text\.(\S+):$", raw):
            name, insts, labels, where, expect = m.group(1), [], {}, (None, 0), None
            funcs[name] = (insts, labels)
        elif name is None:
            continue
        elif m := re.match(r'\s*//## File "([^"]+)", line (\d+)(.*)', raw):
            # The innermost frame in a kernel file: inlined helpers (kernel_common.cuh, wmma,
            # intrinsics) count for the kernel line that called them. An inlined location
            # "A inlined at B" is followed by one line per caller frame ("B inlined at C", ...):
            # those continue it, they start no new location.
            # normpath: an include path with ".." (CMake's xla_ext/cuda/..) names the files
            here = (os.path.normpath(m.group(1)), int(m.group(2)))
            caller = re.search(r'inlined at "([^"]+)", line (\d+)', m.group(3))
            caller = (os.path.normpath(caller.group(1)), int(caller.group(2))) if caller else None
            frames = [caller] if here == expect else [here, caller]
            if here != expect:
                where = (None, 0)
            expect = caller
            for frame in frames:
                if where[0] is None and frame is not None and frame[0].endswith(KERNEL_FILES):
                    where = (pathlib.Path(frame[0]).name, frame[1])
        elif m := re.match(r"^(\.L_x_\d+):", raw):
            labels[m.group(1)] = len(insts)
        elif m := re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", raw):
            insts.append(Instruction(m.group(1), *where))
    return funcs


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def source_lines(file: str) -> list[str]:
    return (CUDA_DIR / file).read_text().splitlines()


def span_lines(span) -> set:
    """1-based line numbers of a region span (see :data:`REGIONS`)."""
    file, within, first, last = span
    text = (CUDA_DIR / file).read_text()
    base = text.index(within)
    start = text.index(first, base)
    stop = text.index(last, start + len(first)) if last else start
    first_no = text.count("\n", 0, start) + 1
    last_no = text.count("\n", 0, stop) + 1
    return {(file, n) for n in range(first_no, last_no + 1)}


def loop_ranges(insts, labels, loop_line) -> list[tuple[int, int]]:
    """Index ranges of the SASS loops whose back edge comes from ``loop_line``."""
    out = []
    for i, ins in enumerate(insts):
        m = re.search(r"BRA\b.*`\((\.L_x_\d+)\)", ins.text)
        if m and (ins.file, ins.line) == loop_line and labels.get(m.group(1), i + 1) <= i:
            out.append((labels[m.group(1)], i))
    return out


def count_kernel(template: str, insts, labels) -> dict:
    """Instructions per unit of every region, and the per-warp rest of the kernel (``cta``)."""
    claimed = [None] * len(insts)
    figures = {}
    regions = REGIONS[template]
    for name, (unit, spans) in regions.items():
        if unit == "trip":
            continue
        lines = set().union(*(span_lines(s) for s in spans))
        for i, ins in enumerate(insts):
            if claimed[i] is None and (ins.file, ins.line) in lines:
                claimed[i] = name
    for name, (unit, spans) in regions.items():
        if unit != "trip":
            continue
        (loop_line,) = span_lines(spans[0])
        ranges = loop_ranges(insts, labels, loop_line)
        if not ranges and not any((ins.file, ins.line) == loop_line for ins in insts):
            continue  # not compiled in this instantiation
        if not ranges:
            raise RuntimeError(f"{template}: no SASS loop closes at {loop_line}")
        for lo, hi in ranges:
            for i in range(lo, hi + 1):
                if claimed[i] is None:
                    claimed[i] = name
    sizes = Counter(claimed)
    for name, (unit, _) in regions.items():
        if unit == "trip":
            if sizes[name]:
                figures[name] = sizes[name]
            continue
        units = sum(1 for ins, c in zip(insts, claimed) if c == name and opcode(ins.text)
                    .startswith(unit))  # fmt: skip
        if unit == "HMMA":
            units /= HMMA_PER_MMA
        if not units and not sizes[name]:
            continue  # not compiled in this instantiation (float32 has no tensor-core path)
        if not units:
            raise RuntimeError(f"{template}: region {name} holds no {unit}")
        figures[name] = round(sizes[name] / units, 2)
    figures["cta"] = sizes[None]
    return figures


# What the build test (tests/test_cuda_build.py) requires of the tensor-core product and dvalues
# kernels: two thread blocks of 256 threads per SM, no runtime integer division in the pipeline
# loop, and no 16-bit global loads or stores anywhere.
GUARDED = {"block_product_tc_kernel": "stage", "block_sddmm_tc_kernel": "stage"}
MAX_GUARDED_REGISTERS = 128
DIVISION = re.compile(r"^(MUFU\.RCP|I2F\.U32\.RP|I2F\.RP)")
NARROW_GLOBAL = re.compile(r"^(LDG|STG|LDGSTS)\S*\.(U16|S16|16)\b")


def guard_violations(log: str, sass: str) -> list[str]:
    """Every breach of :data:`GUARDED`'s rules in a build (ptxas -v log, nvdisasm -gi text)."""
    res = resources(log)
    out = []
    for mangled, (insts, labels) in sass_functions(sass).items():
        key = demangle_key(mangled)
        if key is None or key[0] not in GUARDED:
            continue
        registers = res[mangled][0]
        if registers > MAX_GUARDED_REGISTERS:
            out.append(f"{key}: {registers} registers (at most {MAX_GUARDED_REGISTERS})")
        (_, spans) = REGIONS[key[0]][GUARDED[key[0]]]
        (loop_line,) = span_lines(spans[0])
        ranges = loop_ranges(insts, labels, loop_line)
        if not ranges:
            out.append(f"{key}: no SASS loop closes at {loop_line}")
        for lo, hi in ranges:
            body = (insts[i].text for i in range(lo, hi + 1))
            found = [text for text in body if DIVISION.match(opcode(text))]
            if found:
                out.append(f"{key}: runtime division in the main loop: {found[:3]}")
        narrow = [i.text for i in insts if NARROW_GLOBAL.match(opcode(i.text))]
        if narrow:
            out.append(f"{key}: {len(narrow)} 16-bit global accesses, e.g. {narrow[0]}")
    return out


def demangle_key(mangled: str):
    """``(template, dtype, flags)`` of a kernel symbol, or None for device functions."""
    m = re.match(r"_ZN8dynadiag4cuda\d+(\w+?)I(6__half|13__nv_bfloat16|f)(.*)EEvNS0_", mangled)
    if not m or m.group(1) not in REGIONS:
        return None
    # template flags (Lb0E / Lb1E) and integer parameters (Li16E: b and the panel width)
    flags = tuple(
        v == "1" if kind == "b" else int(v) for kind, v in re.findall(r"L([bi])(\d+)E", m.group(3))
    )
    return m.group(1), DTYPES[m.group(2)], flags


def count_all(log: str, sass: str) -> dict:
    """``{(template, dtype, flags): {"registers", "smem", "regions": {...}}}``."""
    res = resources(log)
    table = {}
    for mangled, (insts, labels) in sass_functions(sass).items():
        key = demangle_key(mangled)
        if key is None:
            continue
        registers, smem = res[mangled]
        table[key] = {
            "registers": registers,
            "smem": smem,
            "regions": count_kernel(key[0], insts, labels),
        }
    return dict(sorted(table.items()))


def _entries(table: dict) -> str:
    """``KERNELS``'s body laid out as ``ruff format`` lays it out."""
    lines = []
    for (kernel, dtype, flags), entry in table.items():
        flags_text = "(" + ", ".join(map(str, flags)) + ("," if len(flags) == 1 else "") + ")"
        lines += [
            f'    ("{kernel}", "{dtype}", {flags_text}): {{',
            f'        "registers": {entry["registers"]},',
            f'        "smem": {entry["smem"]},',
            '        "regions": {',
            *(f'            "{name}": {value},' for name, value in entry["regions"].items()),
            "        },",
            "    },",
        ]
    return "\n".join(lines)


def render(table: dict, version: str) -> str:
    """The source of dynadiag_jax/gpu_sass.py."""
    return f'''"""SASS instruction counts and resources of the CUDA kernels (generated).

Written by ``python scripts/sass_counts.py --write`` from nvcc {version} for sm_{ARCH}; the method
and the regions are described there and in docs/gpu_cost_model.md. Keys: ``(kernel template,
dtype, template flags)``; per kernel the registers per thread and static shared memory per block
from ``ptxas -v``, and per region the SASS instructions a warp issues per unit (``HMMA``: per
m16n16k16 product, ``FFMA``/``LDG``/``STG``: per warp instruction of that kind, ``stage``: per
pipeline loop trip, ``cta``: per warp of each thread block).
"""

NVCC_VERSION = "{version}"
ARCH = "sm_{ARCH}"

KERNELS = {{
{_entries(table)}
}}
'''


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {TABLE.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    nvcc, nvdisasm = find_tool("nvcc"), find_tool("nvdisasm")
    if nvcc is None or nvdisasm is None:
        print("error: needs nvcc and nvdisasm (pip install nvidia-cuda-nvdisasm)", file=sys.stderr)
        return 2
    import jax  # noqa: PLC0415 - only for the XLA FFI headers

    print(
        f"compiling the CUDA device code for sm_{ARCH} with {nvcc} (minutes on two cores) ...",
        file=sys.stderr,
        flush=True,
    )
    log, sass = compile_and_disassemble(nvcc, nvdisasm, jax.ffi.include_dir())
    text = render(count_all(log, sass), nvcc_version(nvcc))
    if args.write:
        TABLE.write_text(text)
        print(f"wrote {TABLE}", file=sys.stderr)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
