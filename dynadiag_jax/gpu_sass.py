"""SASS instruction counts and resources of the CUDA kernels (generated).

Written by ``python scripts/sass_counts.py --write`` from nvcc 13.0.88 for sm_90; the method
and the regions are described there and in docs/gpu_cost_model.md. Keys: ``(kernel template,
dtype, template flags)``; per kernel the registers per thread and static shared memory per block
from ``ptxas -v``, and per region the SASS instructions a warp issues per unit (``HMMA``: per
m16n16k16 product, ``FFMA``/``LDG``/``STG``: per warp instruction of that kind, ``stage``: per
pipeline loop trip, ``cta``: per warp of each thread block).
"""

NVCC_VERSION = "13.0.88"
ARCH = "sm_90"

KERNELS = {
    ("block_product_simt_kernel", "bfloat16", (False, False)): {
        "registers": 206,
        "smem": 16384,
        "regions": {
            "fma": 10.56,
            "x_load": 43.06,
            "w_load": 65.75,
            "store": 18.78,
            "stage": 334,
            "cta": 413,
        },
    },
    ("block_product_simt_kernel", "bfloat16", (False, True)): {
        "registers": 198,
        "smem": 16384,
        "regions": {
            "fma": 10.56,
            "x_load": 43.06,
            "w_load": 134.88,
            "store": 18.78,
            "stage": 328,
            "cta": 417,
        },
    },
    ("block_product_simt_kernel", "bfloat16", (True, False)): {
        "registers": 213,
        "smem": 16384,
        "regions": {
            "fma": 10.56,
            "x_load": 42.94,
            "w_load": 65.75,
            "store": 20.69,
            "stage": 165,
            "cta": 468,
        },
    },
    ("block_product_simt_kernel", "bfloat16", (True, True)): {
        "registers": 203,
        "smem": 16384,
        "regions": {
            "fma": 10.56,
            "x_load": 43.19,
            "w_load": 133.5,
            "store": 20.58,
            "stage": 165,
            "cta": 466,
        },
    },
    ("block_product_simt_kernel", "float16", (False, False)): {
        "registers": 206,
        "smem": 16384,
        "regions": {
            "fma": 10.56,
            "x_load": 43.06,
            "w_load": 65.75,
            "store": 18.78,
            "stage": 334,
            "cta": 413,
        },
    },
    ("block_product_simt_kernel", "float16", (False, True)): {
        "registers": 198,
        "smem": 16384,
        "regions": {
            "fma": 10.56,
            "x_load": 43.06,
            "w_load": 134.88,
            "store": 18.78,
            "stage": 328,
            "cta": 417,
        },
    },
    ("block_product_simt_kernel", "float16", (True, False)): {
        "registers": 213,
        "smem": 16384,
        "regions": {
            "fma": 10.56,
            "x_load": 42.94,
            "w_load": 65.75,
            "store": 20.69,
            "stage": 165,
            "cta": 468,
        },
    },
    ("block_product_simt_kernel", "float16", (True, True)): {
        "registers": 203,
        "smem": 16384,
        "regions": {
            "fma": 10.56,
            "x_load": 43.19,
            "w_load": 133.5,
            "store": 20.58,
            "stage": 165,
            "cta": 466,
        },
    },
    ("block_product_simt_kernel", "float32", (False, False)): {
        "registers": 210,
        "smem": 32768,
        "regions": {
            "fma": 9.55,
            "x_load": 42.38,
            "w_load": 65.81,
            "store": 17.79,
            "stage": 340,
            "cta": 417,
        },
    },
    ("block_product_simt_kernel", "float32", (False, True)): {
        "registers": 198,
        "smem": 32768,
        "regions": {
            "fma": 9.55,
            "x_load": 42.19,
            "w_load": 135.0,
            "store": 17.79,
            "stage": 334,
            "cta": 415,
        },
    },
    ("block_product_simt_kernel", "float32", (True, False)): {
        "registers": 213,
        "smem": 32768,
        "regions": {
            "fma": 9.55,
            "x_load": 42.25,
            "w_load": 65.88,
            "store": 20.04,
            "stage": 172,
            "cta": 466,
        },
    },
    ("block_product_simt_kernel", "float32", (True, True)): {
        "registers": 204,
        "smem": 32768,
        "regions": {
            "fma": 9.55,
            "x_load": 42.19,
            "w_load": 133.69,
            "store": 20.05,
            "stage": 172,
            "cta": 461,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (False, False)): {
        "registers": 194,
        "smem": 40960,
        "regions": {
            "mma": 32.0,
            "x_load": 16.5,
            "w_load": 61.31,
            "store": 28.36,
            "stage": 685,
            "cta": 409,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (False, True)): {
        "registers": 193,
        "smem": 40960,
        "regions": {
            "mma": 36.25,
            "x_load": 16.5,
            "w_load": 140.12,
            "store": 28.34,
            "stage": 705,
            "cta": 505,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, False)): {
        "registers": 198,
        "smem": 40960,
        "regions": {
            "mma": 32.0,
            "x_load": 16.5,
            "w_load": 58.22,
            "store": 68.06,
            "stage": 365,
            "cta": 485,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, True)): {
        "registers": 197,
        "smem": 40960,
        "regions": {
            "mma": 36.0,
            "x_load": 16.5,
            "w_load": 139.69,
            "store": 68.06,
            "stage": 367,
            "cta": 484,
        },
    },
    ("block_product_tc_kernel", "float16", (False, False)): {
        "registers": 194,
        "smem": 40960,
        "regions": {
            "mma": 25.94,
            "x_load": 16.5,
            "w_load": 61.88,
            "store": 28.27,
            "stage": 656,
            "cta": 415,
        },
    },
    ("block_product_tc_kernel", "float16", (False, True)): {
        "registers": 193,
        "smem": 40960,
        "regions": {
            "mma": 29.94,
            "x_load": 16.5,
            "w_load": 140.66,
            "store": 28.27,
            "stage": 660,
            "cta": 498,
        },
    },
    ("block_product_tc_kernel", "float16", (True, False)): {
        "registers": 198,
        "smem": 40960,
        "regions": {
            "mma": 25.94,
            "x_load": 16.5,
            "w_load": 57.94,
            "store": 67.97,
            "stage": 348,
            "cta": 482,
        },
    },
    ("block_product_tc_kernel", "float16", (True, True)): {
        "registers": 197,
        "smem": 40960,
        "regions": {
            "mma": 29.94,
            "x_load": 16.5,
            "w_load": 139.97,
            "store": 67.97,
            "stage": 349,
            "cta": 488,
        },
    },
    ("block_sddmm_simt_kernel", "bfloat16", ()): {
        "registers": 212,
        "smem": 32768,
        "regions": {
            "fma": 14.27,
            "load": 40.25,
            "store": 138.91,
            "stage": 18,
            "cta": 414,
        },
    },
    ("block_sddmm_simt_kernel", "float16", ()): {
        "registers": 212,
        "smem": 32768,
        "regions": {
            "fma": 14.27,
            "load": 40.25,
            "store": 138.91,
            "stage": 18,
            "cta": 412,
        },
    },
    ("block_sddmm_simt_kernel", "float32", ()): {
        "registers": 168,
        "smem": 32768,
        "regions": {
            "fma": 12.22,
            "load": 40.04,
            "store": 138.45,
            "stage": 17,
            "cta": 471,
        },
    },
    ("block_sddmm_tc_kernel", "bfloat16", ()): {
        "registers": 156,
        "smem": 40960,
        "regions": {
            "mma": 171.0,
            "load": 40.58,
            "store": 37.57,
            "stage": 109,
            "cta": 387,
        },
    },
    ("block_sddmm_tc_kernel", "float16", ()): {
        "registers": 150,
        "smem": 40960,
        "regions": {
            "mma": 141.75,
            "load": 40.49,
            "store": 37.79,
            "stage": 114,
            "cta": 395,
        },
    },
    ("element_plan_kernel", "bfloat16", (False,)): {
        "registers": 29,
        "smem": 19464,
        "regions": {
            "cta": 1048,
        },
    },
    ("element_plan_kernel", "bfloat16", (True,)): {
        "registers": 32,
        "smem": 19464,
        "regions": {
            "cta": 1200,
        },
    },
    ("element_plan_kernel", "float16", (False,)): {
        "registers": 29,
        "smem": 19464,
        "regions": {
            "cta": 1048,
        },
    },
    ("element_plan_kernel", "float16", (True,)): {
        "registers": 32,
        "smem": 19464,
        "regions": {
            "cta": 1200,
        },
    },
    ("element_plan_kernel", "float32", (False,)): {
        "registers": 30,
        "smem": 19464,
        "regions": {
            "cta": 1024,
        },
    },
    ("element_plan_kernel", "float32", (True,)): {
        "registers": 31,
        "smem": 19464,
        "regions": {
            "cta": 1176,
        },
    },
    ("element_product_kernel", "bfloat16", (False,)): {
        "registers": 62,
        "smem": 28704,
        "regions": {
            "mma": 39.0,
            "x_load": 19.38,
            "tc_store": 50.0,
            "stage": 139,
            "fma": 13.12,
            "diag_store": 12.56,
            "cta": 519,
        },
    },
    ("element_product_kernel", "bfloat16", (True,)): {
        "registers": 62,
        "smem": 28704,
        "regions": {
            "mma": 39.0,
            "x_load": 19.66,
            "tc_store": 52.0,
            "stage": 138,
            "fma": 13.62,
            "diag_store": 12.88,
            "cta": 532,
        },
    },
    ("element_product_kernel", "float16", (False,)): {
        "registers": 62,
        "smem": 28704,
        "regions": {
            "mma": 32.5,
            "x_load": 19.66,
            "tc_store": 50.0,
            "stage": 143,
            "fma": 13.12,
            "diag_store": 12.56,
            "cta": 519,
        },
    },
    ("element_product_kernel", "float16", (True,)): {
        "registers": 62,
        "smem": 28704,
        "regions": {
            "mma": 32.5,
            "x_load": 19.91,
            "tc_store": 52.0,
            "stage": 142,
            "fma": 13.62,
            "diag_store": 12.88,
            "cta": 533,
        },
    },
    ("element_product_kernel", "float32", (False,)): {
        "registers": 48,
        "smem": 2052,
        "regions": {
            "fma": 12.0,
            "diag_store": 12.44,
            "cta": 401,
        },
    },
    ("element_product_kernel", "float32", (True,)): {
        "registers": 54,
        "smem": 2052,
        "regions": {
            "fma": 12.0,
            "diag_store": 12.44,
            "cta": 425,
        },
    },
    ("sddmm_kernel", "bfloat16", ()): {
        "registers": 64,
        "smem": 8192,
        "regions": {
            "fma": 17.92,
            "cta": 250,
        },
    },
    ("sddmm_kernel", "float16", ()): {
        "registers": 64,
        "smem": 8192,
        "regions": {
            "fma": 17.92,
            "cta": 250,
        },
    },
    ("sddmm_kernel", "float32", ()): {
        "registers": 64,
        "smem": 8192,
        "regions": {
            "fma": 16.08,
            "cta": 246,
        },
    },
    ("sddmm_reduce_kernel", "bfloat16", ()): {
        "registers": 32,
        "smem": 0,
        "regions": {
            "load": 5.9,
            "cta": 29,
        },
    },
    ("sddmm_reduce_kernel", "float16", ()): {
        "registers": 32,
        "smem": 0,
        "regions": {
            "load": 5.9,
            "cta": 29,
        },
    },
    ("sddmm_reduce_kernel", "float32", ()): {
        "registers": 32,
        "smem": 0,
        "regions": {
            "load": 5.9,
            "cta": 29,
        },
    },
}
