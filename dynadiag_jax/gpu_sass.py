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
    ("block_product_tc_kernel", "bfloat16", (False, False, 16, 16)): {
        "registers": 57,
        "smem": 42240,
        "regions": {
            "mma": 16.0,
            "store": 42.0,
            "stage": 65,
            "cta": 411,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (False, False, 32, 32)): {
        "registers": 75,
        "smem": 44544,
        "regions": {
            "mma": 9.5,
            "store": 34.25,
            "stage": 91,
            "cta": 438,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (False, False, 64, 64)): {
        "registers": 116,
        "smem": 49152,
        "regions": {
            "mma": 6.5,
            "store": 30.12,
            "stage": 89,
            "cta": 466,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (False, False, 128, 128)): {
        "registers": 119,
        "smem": 39936,
        "regions": {
            "mma": 7.62,
            "store": 37.62,
            "stage": 81,
            "cta": 445,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (False, True, 16, 16)): {
        "registers": 57,
        "smem": 42240,
        "regions": {
            "mma": 14.0,
            "store": 42.0,
            "stage": 65,
            "cta": 407,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (False, True, 32, 32)): {
        "registers": 74,
        "smem": 44544,
        "regions": {
            "mma": 8.75,
            "store": 34.25,
            "stage": 89,
            "cta": 427,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (False, True, 64, 64)): {
        "registers": 115,
        "smem": 49152,
        "regions": {
            "mma": 6.12,
            "store": 30.12,
            "stage": 88,
            "cta": 462,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (False, True, 128, 128)): {
        "registers": 118,
        "smem": 39936,
        "regions": {
            "mma": 7.25,
            "store": 37.62,
            "stage": 79,
            "cta": 442,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, False, 16, 16)): {
        "registers": 63,
        "smem": 42240,
        "regions": {
            "mma": 17.0,
            "store": 42.0,
            "stage": 66,
            "cta": 472,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, False, 16, 32)): {
        "registers": 78,
        "smem": 44544,
        "regions": {
            "mma": 12.75,
            "store": 38.25,
            "stage": 83,
            "cta": 545,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, False, 16, 64)): {
        "registers": 110,
        "smem": 49152,
        "regions": {
            "mma": 10.62,
            "store": 35.88,
            "stage": 83,
            "cta": 625,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, False, 16, 128)): {
        "registers": 101,
        "smem": 39936,
        "regions": {
            "mma": 17.0,
            "store": 54.25,
            "stage": 74,
            "cta": 524,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, False, 32, 32)): {
        "registers": 77,
        "smem": 44544,
        "regions": {
            "mma": 12.25,
            "store": 34.5,
            "stage": 95,
            "cta": 534,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, False, 32, 64)): {
        "registers": 112,
        "smem": 49152,
        "regions": {
            "mma": 10.25,
            "store": 32.12,
            "stage": 96,
            "cta": 621,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, False, 32, 128)): {
        "registers": 100,
        "smem": 39936,
        "regions": {
            "mma": 16.12,
            "store": 49.62,
            "stage": 87,
            "cta": 515,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, False, 64, 64)): {
        "registers": 112,
        "smem": 49152,
        "regions": {
            "mma": 10.12,
            "store": 30.25,
            "stage": 95,
            "cta": 614,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, False, 64, 128)): {
        "registers": 100,
        "smem": 39936,
        "regions": {
            "mma": 15.88,
            "store": 46.88,
            "stage": 86,
            "cta": 516,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, False, 128, 128)): {
        "registers": 100,
        "smem": 39936,
        "regions": {
            "mma": 15.75,
            "store": 44.75,
            "stage": 87,
            "cta": 525,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, True, 16, 16)): {
        "registers": 59,
        "smem": 42240,
        "regions": {
            "mma": 15.0,
            "store": 42.0,
            "stage": 64,
            "cta": 454,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, True, 16, 32)): {
        "registers": 76,
        "smem": 44544,
        "regions": {
            "mma": 11.25,
            "store": 38.25,
            "stage": 81,
            "cta": 537,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, True, 16, 64)): {
        "registers": 108,
        "smem": 49152,
        "regions": {
            "mma": 9.12,
            "store": 35.88,
            "stage": 81,
            "cta": 623,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, True, 16, 128)): {
        "registers": 99,
        "smem": 39936,
        "regions": {
            "mma": 14.0,
            "store": 54.25,
            "stage": 72,
            "cta": 518,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, True, 32, 32)): {
        "registers": 74,
        "smem": 44544,
        "regions": {
            "mma": 10.75,
            "store": 34.5,
            "stage": 89,
            "cta": 506,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, True, 32, 64)): {
        "registers": 109,
        "smem": 49152,
        "regions": {
            "mma": 8.75,
            "store": 32.12,
            "stage": 97,
            "cta": 616,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, True, 32, 128)): {
        "registers": 100,
        "smem": 39936,
        "regions": {
            "mma": 13.12,
            "store": 49.62,
            "stage": 87,
            "cta": 515,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, True, 64, 64)): {
        "registers": 108,
        "smem": 49152,
        "regions": {
            "mma": 8.62,
            "store": 30.25,
            "stage": 90,
            "cta": 583,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, True, 64, 128)): {
        "registers": 100,
        "smem": 39936,
        "regions": {
            "mma": 12.88,
            "store": 46.88,
            "stage": 86,
            "cta": 516,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, True, 128, 128)): {
        "registers": 96,
        "smem": 39936,
        "regions": {
            "mma": 12.75,
            "store": 43.75,
            "stage": 80,
            "cta": 500,
        },
    },
    ("block_product_tc_kernel", "float16", (False, False, 16, 16)): {
        "registers": 64,
        "smem": 42240,
        "regions": {
            "mma": 15.67,
            "store": 41.5,
            "stage": 151,
            "cta": 512,
        },
    },
    ("block_product_tc_kernel", "float16", (False, False, 32, 32)): {
        "registers": 81,
        "smem": 44544,
        "regions": {
            "mma": 9.25,
            "store": 34.25,
            "stage": 152,
            "cta": 437,
        },
    },
    ("block_product_tc_kernel", "float16", (False, False, 64, 64)): {
        "registers": 118,
        "smem": 49152,
        "regions": {
            "mma": 6.5,
            "store": 30.12,
            "stage": 165,
            "cta": 466,
        },
    },
    ("block_product_tc_kernel", "float16", (False, False, 128, 128)): {
        "registers": 121,
        "smem": 39936,
        "regions": {
            "mma": 7.62,
            "store": 37.62,
            "stage": 148,
            "cta": 445,
        },
    },
    ("block_product_tc_kernel", "float16", (False, True, 16, 16)): {
        "registers": 64,
        "smem": 42240,
        "regions": {
            "mma": 13.67,
            "store": 41.5,
            "stage": 139,
            "cta": 488,
        },
    },
    ("block_product_tc_kernel", "float16", (False, True, 32, 32)): {
        "registers": 81,
        "smem": 44544,
        "regions": {
            "mma": 8.5,
            "store": 34.25,
            "stage": 145,
            "cta": 426,
        },
    },
    ("block_product_tc_kernel", "float16", (False, True, 64, 64)): {
        "registers": 117,
        "smem": 49152,
        "regions": {
            "mma": 6.12,
            "store": 30.12,
            "stage": 163,
            "cta": 458,
        },
    },
    ("block_product_tc_kernel", "float16", (False, True, 128, 128)): {
        "registers": 120,
        "smem": 39936,
        "regions": {
            "mma": 7.25,
            "store": 37.62,
            "stage": 144,
            "cta": 439,
        },
    },
    ("block_product_tc_kernel", "float16", (True, False, 16, 16)): {
        "registers": 70,
        "smem": 42240,
        "regions": {
            "mma": 16.67,
            "store": 42.0,
            "stage": 163,
            "cta": 589,
        },
    },
    ("block_product_tc_kernel", "float16", (True, False, 16, 32)): {
        "registers": 88,
        "smem": 44544,
        "regions": {
            "mma": 12.58,
            "store": 38.25,
            "stage": 164,
            "cta": 644,
        },
    },
    ("block_product_tc_kernel", "float16", (True, False, 16, 64)): {
        "registers": 119,
        "smem": 49152,
        "regions": {
            "mma": 10.54,
            "store": 35.88,
            "stage": 165,
            "cta": 727,
        },
    },
    ("block_product_tc_kernel", "float16", (True, False, 16, 128)): {
        "registers": 110,
        "smem": 39936,
        "regions": {
            "mma": 16.79,
            "store": 54.38,
            "stage": 148,
            "cta": 614,
        },
    },
    ("block_product_tc_kernel", "float16", (True, False, 32, 32)): {
        "registers": 83,
        "smem": 44544,
        "regions": {
            "mma": 12.0,
            "store": 34.5,
            "stage": 164,
            "cta": 530,
        },
    },
    ("block_product_tc_kernel", "float16", (True, False, 32, 64)): {
        "registers": 114,
        "smem": 49152,
        "regions": {
            "mma": 10.12,
            "store": 32.12,
            "stage": 164,
            "cta": 617,
        },
    },
    ("block_product_tc_kernel", "float16", (True, False, 32, 128)): {
        "registers": 102,
        "smem": 39936,
        "regions": {
            "mma": 16.12,
            "store": 49.62,
            "stage": 86,
            "cta": 516,
        },
    },
    ("block_product_tc_kernel", "float16", (True, False, 64, 64)): {
        "registers": 109,
        "smem": 49152,
        "regions": {
            "mma": 10.12,
            "store": 30.25,
            "stage": 175,
            "cta": 605,
        },
    },
    ("block_product_tc_kernel", "float16", (True, False, 64, 128)): {
        "registers": 102,
        "smem": 39936,
        "regions": {
            "mma": 15.88,
            "store": 46.88,
            "stage": 85,
            "cta": 517,
        },
    },
    ("block_product_tc_kernel", "float16", (True, False, 128, 128)): {
        "registers": 100,
        "smem": 39936,
        "regions": {
            "mma": 15.75,
            "store": 44.75,
            "stage": 86,
            "cta": 526,
        },
    },
    ("block_product_tc_kernel", "float16", (True, True, 16, 16)): {
        "registers": 69,
        "smem": 42240,
        "regions": {
            "mma": 14.67,
            "store": 42.0,
            "stage": 141,
            "cta": 543,
        },
    },
    ("block_product_tc_kernel", "float16", (True, True, 16, 32)): {
        "registers": 87,
        "smem": 44544,
        "regions": {
            "mma": 11.08,
            "store": 38.25,
            "stage": 160,
            "cta": 634,
        },
    },
    ("block_product_tc_kernel", "float16", (True, True, 16, 64)): {
        "registers": 117,
        "smem": 49152,
        "regions": {
            "mma": 9.04,
            "store": 35.88,
            "stage": 161,
            "cta": 719,
        },
    },
    ("block_product_tc_kernel", "float16", (True, True, 16, 128)): {
        "registers": 108,
        "smem": 39936,
        "regions": {
            "mma": 13.79,
            "store": 54.38,
            "stage": 144,
            "cta": 602,
        },
    },
    ("block_product_tc_kernel", "float16", (True, True, 32, 32)): {
        "registers": 80,
        "smem": 44544,
        "regions": {
            "mma": 10.5,
            "store": 34.5,
            "stage": 147,
            "cta": 503,
        },
    },
    ("block_product_tc_kernel", "float16", (True, True, 32, 64)): {
        "registers": 113,
        "smem": 49152,
        "regions": {
            "mma": 8.62,
            "store": 32.12,
            "stage": 162,
            "cta": 619,
        },
    },
    ("block_product_tc_kernel", "float16", (True, True, 32, 128)): {
        "registers": 100,
        "smem": 39936,
        "regions": {
            "mma": 13.12,
            "store": 49.62,
            "stage": 87,
            "cta": 515,
        },
    },
    ("block_product_tc_kernel", "float16", (True, True, 64, 64)): {
        "registers": 106,
        "smem": 49152,
        "regions": {
            "mma": 8.62,
            "store": 30.25,
            "stage": 165,
            "cta": 583,
        },
    },
    ("block_product_tc_kernel", "float16", (True, True, 64, 128)): {
        "registers": 100,
        "smem": 39936,
        "regions": {
            "mma": 12.88,
            "store": 46.88,
            "stage": 86,
            "cta": 516,
        },
    },
    ("block_product_tc_kernel", "float16", (True, True, 128, 128)): {
        "registers": 96,
        "smem": 39936,
        "regions": {
            "mma": 12.75,
            "store": 43.75,
            "stage": 80,
            "cta": 500,
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
    ("block_sddmm_tc_kernel", "bfloat16", (16,)): {
        "registers": 126,
        "smem": 46120,
        "regions": {
            "mma": 27.69,
            "load": 15.22,
            "store": 39.67,
            "stage": 54,
            "cta": 1158,
        },
    },
    ("block_sddmm_tc_kernel", "bfloat16", (32,)): {
        "registers": 128,
        "smem": 46104,
        "regions": {
            "mma": 27.69,
            "load": 15.22,
            "store": 42.33,
            "stage": 54,
            "cta": 1294,
        },
    },
    ("block_sddmm_tc_kernel", "bfloat16", (64,)): {
        "registers": 126,
        "smem": 41496,
        "regions": {
            "mma": 27.12,
            "load": 15.22,
            "store": 42.33,
            "stage": 54,
            "cta": 1296,
        },
    },
    ("block_sddmm_tc_kernel", "bfloat16", (128,)): {
        "registers": 126,
        "smem": 39180,
        "regions": {
            "mma": 27.12,
            "load": 15.22,
            "store": 42.33,
            "stage": 54,
            "cta": 1296,
        },
    },
    ("block_sddmm_tc_kernel", "float16", (16,)): {
        "registers": 120,
        "smem": 46120,
        "regions": {
            "mma": 27.69,
            "load": 17.22,
            "store": 39.46,
            "stage": 51,
            "cta": 1172,
        },
    },
    ("block_sddmm_tc_kernel", "float16", (32,)): {
        "registers": 120,
        "smem": 46104,
        "regions": {
            "mma": 27.69,
            "load": 17.0,
            "store": 42.42,
            "stage": 53,
            "cta": 1309,
        },
    },
    ("block_sddmm_tc_kernel", "float16", (64,)): {
        "registers": 126,
        "smem": 41496,
        "regions": {
            "mma": 27.25,
            "load": 15.56,
            "store": 42.38,
            "stage": 50,
            "cta": 1295,
        },
    },
    ("block_sddmm_tc_kernel", "float16", (128,)): {
        "registers": 126,
        "smem": 39180,
        "regions": {
            "mma": 27.25,
            "load": 15.56,
            "store": 42.38,
            "stage": 50,
            "cta": 1295,
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
