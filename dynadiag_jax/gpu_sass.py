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
        "registers": 63,
        "smem": 39424,
        "regions": {
            "mma": 15.67,
            "store": 43.5,
            "stage": 140,
            "cta": 447,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (False, False, 32, 32)): {
        "registers": 79,
        "smem": 40960,
        "regions": {
            "mma": 9.75,
            "store": 35.25,
            "stage": 83,
            "cta": 361,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (False, False, 64, 64)): {
        "registers": 117,
        "smem": 44032,
        "regions": {
            "mma": 6.62,
            "store": 30.62,
            "stage": 82,
            "cta": 396,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (False, False, 128, 128)): {
        "registers": 121,
        "smem": 37888,
        "regions": {
            "mma": 7.75,
            "store": 38.25,
            "stage": 73,
            "cta": 383,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (False, True, 16, 16)): {
        "registers": 63,
        "smem": 39424,
        "regions": {
            "mma": 13.67,
            "store": 43.5,
            "stage": 128,
            "cta": 431,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (False, True, 32, 32)): {
        "registers": 77,
        "smem": 40960,
        "regions": {
            "mma": 9.0,
            "store": 35.25,
            "stage": 81,
            "cta": 358,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (False, True, 64, 64)): {
        "registers": 116,
        "smem": 44032,
        "regions": {
            "mma": 6.25,
            "store": 30.62,
            "stage": 81,
            "cta": 392,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (False, True, 128, 128)): {
        "registers": 119,
        "smem": 37888,
        "regions": {
            "mma": 7.38,
            "store": 38.25,
            "stage": 71,
            "cta": 380,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, False, 16, 16)): {
        "registers": 67,
        "smem": 39424,
        "regions": {
            "mma": 16.67,
            "store": 43.0,
            "stage": 153,
            "cta": 517,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, False, 16, 32)): {
        "registers": 80,
        "smem": 40960,
        "regions": {
            "mma": 12.75,
            "store": 39.25,
            "stage": 81,
            "cta": 463,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, False, 16, 64)): {
        "registers": 112,
        "smem": 44032,
        "regions": {
            "mma": 10.62,
            "store": 36.38,
            "stage": 81,
            "cta": 551,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, False, 16, 128)): {
        "registers": 103,
        "smem": 37888,
        "regions": {
            "mma": 17.0,
            "store": 55.88,
            "stage": 72,
            "cta": 457,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, False, 32, 32)): {
        "registers": 83,
        "smem": 40960,
        "regions": {
            "mma": 12.5,
            "store": 35.5,
            "stage": 85,
            "cta": 467,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, False, 32, 64)): {
        "registers": 115,
        "smem": 44032,
        "regions": {
            "mma": 10.38,
            "store": 32.62,
            "stage": 85,
            "cta": 547,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, False, 32, 128)): {
        "registers": 104,
        "smem": 37888,
        "regions": {
            "mma": 16.25,
            "store": 50.62,
            "stage": 76,
            "cta": 453,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, False, 64, 64)): {
        "registers": 115,
        "smem": 44032,
        "regions": {
            "mma": 10.25,
            "store": 30.75,
            "stage": 85,
            "cta": 539,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, False, 64, 128)): {
        "registers": 106,
        "smem": 37888,
        "regions": {
            "mma": 16.0,
            "store": 47.62,
            "stage": 76,
            "cta": 455,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, False, 128, 128)): {
        "registers": 104,
        "smem": 37888,
        "regions": {
            "mma": 15.88,
            "store": 45.38,
            "stage": 76,
            "cta": 466,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, True, 16, 16)): {
        "registers": 67,
        "smem": 39424,
        "regions": {
            "mma": 14.67,
            "store": 42.5,
            "stage": 131,
            "cta": 488,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, True, 16, 32)): {
        "registers": 78,
        "smem": 40960,
        "regions": {
            "mma": 11.25,
            "store": 39.25,
            "stage": 79,
            "cta": 463,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, True, 16, 64)): {
        "registers": 110,
        "smem": 44032,
        "regions": {
            "mma": 9.12,
            "store": 36.38,
            "stage": 79,
            "cta": 549,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, True, 16, 128)): {
        "registers": 101,
        "smem": 37888,
        "regions": {
            "mma": 14.0,
            "store": 55.75,
            "stage": 70,
            "cta": 452,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, True, 32, 32)): {
        "registers": 78,
        "smem": 40960,
        "regions": {
            "mma": 11.0,
            "store": 35.5,
            "stage": 80,
            "cta": 446,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, True, 32, 64)): {
        "registers": 113,
        "smem": 44032,
        "regions": {
            "mma": 8.88,
            "store": 32.62,
            "stage": 87,
            "cta": 549,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, True, 32, 128)): {
        "registers": 102,
        "smem": 37888,
        "regions": {
            "mma": 13.25,
            "store": 50.62,
            "stage": 78,
            "cta": 451,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, True, 64, 64)): {
        "registers": 110,
        "smem": 44032,
        "regions": {
            "mma": 8.75,
            "store": 30.75,
            "stage": 81,
            "cta": 523,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, True, 64, 128)): {
        "registers": 102,
        "smem": 37888,
        "regions": {
            "mma": 13.0,
            "store": 47.62,
            "stage": 78,
            "cta": 453,
        },
    },
    ("block_product_tc_kernel", "bfloat16", (True, True, 128, 128)): {
        "registers": 99,
        "smem": 37888,
        "regions": {
            "mma": 12.88,
            "store": 44.38,
            "stage": 71,
            "cta": 447,
        },
    },
    ("block_product_tc_kernel", "float16", (False, False, 16, 16)): {
        "registers": 62,
        "smem": 39424,
        "regions": {
            "mma": 15.29,
            "store": 43.5,
            "stage": 247,
            "cta": 580,
        },
    },
    ("block_product_tc_kernel", "float16", (False, False, 32, 32)): {
        "registers": 80,
        "smem": 40960,
        "regions": {
            "mma": 9.5,
            "store": 35.25,
            "stage": 142,
            "cta": 369,
        },
    },
    ("block_product_tc_kernel", "float16", (False, False, 64, 64)): {
        "registers": 119,
        "smem": 44032,
        "regions": {
            "mma": 6.5,
            "store": 30.62,
            "stage": 149,
            "cta": 398,
        },
    },
    ("block_product_tc_kernel", "float16", (False, False, 128, 128)): {
        "registers": 123,
        "smem": 37888,
        "regions": {
            "mma": 7.62,
            "store": 38.25,
            "stage": 131,
            "cta": 393,
        },
    },
    ("block_product_tc_kernel", "float16", (False, True, 16, 16)): {
        "registers": 62,
        "smem": 39424,
        "regions": {
            "mma": 13.29,
            "store": 43.5,
            "stage": 223,
            "cta": 552,
        },
    },
    ("block_product_tc_kernel", "float16", (False, True, 32, 32)): {
        "registers": 80,
        "smem": 40960,
        "regions": {
            "mma": 8.75,
            "store": 35.25,
            "stage": 133,
            "cta": 360,
        },
    },
    ("block_product_tc_kernel", "float16", (False, True, 64, 64)): {
        "registers": 118,
        "smem": 44032,
        "regions": {
            "mma": 6.12,
            "store": 30.62,
            "stage": 147,
            "cta": 398,
        },
    },
    ("block_product_tc_kernel", "float16", (False, True, 128, 128)): {
        "registers": 121,
        "smem": 37888,
        "regions": {
            "mma": 7.25,
            "store": 38.25,
            "stage": 127,
            "cta": 379,
        },
    },
    ("block_product_tc_kernel", "float16", (True, False, 16, 16)): {
        "registers": 67,
        "smem": 39424,
        "regions": {
            "mma": 16.14,
            "store": 43.5,
            "stage": 267,
            "cta": 660,
        },
    },
    ("block_product_tc_kernel", "float16", (True, False, 16, 32)): {
        "registers": 86,
        "smem": 40960,
        "regions": {
            "mma": 12.42,
            "store": 39.25,
            "stage": 154,
            "cta": 564,
        },
    },
    ("block_product_tc_kernel", "float16", (True, False, 16, 64)): {
        "registers": 118,
        "smem": 44032,
        "regions": {
            "mma": 10.29,
            "store": 36.38,
            "stage": 154,
            "cta": 652,
        },
    },
    ("block_product_tc_kernel", "float16", (True, False, 16, 128)): {
        "registers": 108,
        "smem": 37888,
        "regions": {
            "mma": 16.21,
            "store": 55.88,
            "stage": 137,
            "cta": 547,
        },
    },
    ("block_product_tc_kernel", "float16", (True, False, 32, 32)): {
        "registers": 80,
        "smem": 40960,
        "regions": {
            "mma": 12.0,
            "store": 35.5,
            "stage": 153,
            "cta": 465,
        },
    },
    ("block_product_tc_kernel", "float16", (True, False, 32, 64)): {
        "registers": 112,
        "smem": 44032,
        "regions": {
            "mma": 9.88,
            "store": 32.62,
            "stage": 154,
            "cta": 547,
        },
    },
    ("block_product_tc_kernel", "float16", (True, False, 32, 128)): {
        "registers": 104,
        "smem": 37888,
        "regions": {
            "mma": 15.25,
            "store": 50.62,
            "stage": 135,
            "cta": 456,
        },
    },
    ("block_product_tc_kernel", "float16", (True, False, 64, 64)): {
        "registers": 114,
        "smem": 44032,
        "regions": {
            "mma": 9.75,
            "store": 30.75,
            "stage": 161,
            "cta": 541,
        },
    },
    ("block_product_tc_kernel", "float16", (True, False, 64, 128)): {
        "registers": 104,
        "smem": 37888,
        "regions": {
            "mma": 15.0,
            "store": 47.62,
            "stage": 142,
            "cta": 461,
        },
    },
    ("block_product_tc_kernel", "float16", (True, False, 128, 128)): {
        "registers": 103,
        "smem": 37888,
        "regions": {
            "mma": 14.88,
            "store": 45.38,
            "stage": 142,
            "cta": 465,
        },
    },
    ("block_product_tc_kernel", "float16", (True, True, 16, 16)): {
        "registers": 64,
        "smem": 39424,
        "regions": {
            "mma": 14.14,
            "store": 43.0,
            "stage": 227,
            "cta": 609,
        },
    },
    ("block_product_tc_kernel", "float16", (True, True, 16, 32)): {
        "registers": 83,
        "smem": 40960,
        "regions": {
            "mma": 10.92,
            "store": 39.25,
            "stage": 150,
            "cta": 562,
        },
    },
    ("block_product_tc_kernel", "float16", (True, True, 16, 64)): {
        "registers": 115,
        "smem": 44032,
        "regions": {
            "mma": 8.79,
            "store": 36.38,
            "stage": 150,
            "cta": 644,
        },
    },
    ("block_product_tc_kernel", "float16", (True, True, 16, 128)): {
        "registers": 106,
        "smem": 37888,
        "regions": {
            "mma": 13.21,
            "store": 55.88,
            "stage": 133,
            "cta": 543,
        },
    },
    ("block_product_tc_kernel", "float16", (True, True, 32, 32)): {
        "registers": 77,
        "smem": 40960,
        "regions": {
            "mma": 10.5,
            "store": 35.5,
            "stage": 136,
            "cta": 446,
        },
    },
    ("block_product_tc_kernel", "float16", (True, True, 32, 64)): {
        "registers": 110,
        "smem": 44032,
        "regions": {
            "mma": 8.38,
            "store": 32.62,
            "stage": 152,
            "cta": 549,
        },
    },
    ("block_product_tc_kernel", "float16", (True, True, 32, 128)): {
        "registers": 101,
        "smem": 37888,
        "regions": {
            "mma": 12.25,
            "store": 50.62,
            "stage": 133,
            "cta": 458,
        },
    },
    ("block_product_tc_kernel", "float16", (True, True, 64, 64)): {
        "registers": 110,
        "smem": 44032,
        "regions": {
            "mma": 8.25,
            "store": 30.75,
            "stage": 151,
            "cta": 519,
        },
    },
    ("block_product_tc_kernel", "float16", (True, True, 64, 128)): {
        "registers": 101,
        "smem": 37888,
        "regions": {
            "mma": 12.0,
            "store": 47.62,
            "stage": 144,
            "cta": 459,
        },
    },
    ("block_product_tc_kernel", "float16", (True, True, 128, 128)): {
        "registers": 99,
        "smem": 37888,
        "regions": {
            "mma": 11.88,
            "store": 44.38,
            "stage": 130,
            "cta": 453,
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
        "smem": 38952,
        "regions": {
            "mma": 30.69,
            "load": 19.67,
            "store": 39.25,
            "stage": 40,
            "cta": 1121,
        },
    },
    ("block_sddmm_tc_kernel", "bfloat16", (32,)): {
        "registers": 123,
        "smem": 38936,
        "regions": {
            "mma": 30.69,
            "load": 19.5,
            "store": 42.0,
            "stage": 42,
            "cta": 1270,
        },
    },
    ("block_sddmm_tc_kernel", "bfloat16", (64,)): {
        "registers": 122,
        "smem": 35864,
        "regions": {
            "mma": 30.12,
            "load": 19.5,
            "store": 43.0,
            "stage": 42,
            "cta": 1272,
        },
    },
    ("block_sddmm_tc_kernel", "bfloat16", (128,)): {
        "registers": 122,
        "smem": 34316,
        "regions": {
            "mma": 30.12,
            "load": 19.5,
            "store": 43.0,
            "stage": 42,
            "cta": 1272,
        },
    },
    ("block_sddmm_tc_kernel", "float16", (16,)): {
        "registers": 122,
        "smem": 38952,
        "regions": {
            "mma": 30.69,
            "load": 20.5,
            "store": 39.29,
            "stage": 34,
            "cta": 1129,
        },
    },
    ("block_sddmm_tc_kernel", "float16", (32,)): {
        "registers": 123,
        "smem": 38936,
        "regions": {
            "mma": 30.69,
            "load": 19.5,
            "store": 42.0,
            "stage": 40,
            "cta": 1264,
        },
    },
    ("block_sddmm_tc_kernel", "float16", (64,)): {
        "registers": 122,
        "smem": 35864,
        "regions": {
            "mma": 30.12,
            "load": 19.5,
            "store": 43.0,
            "stage": 40,
            "cta": 1274,
        },
    },
    ("block_sddmm_tc_kernel", "float16", (128,)): {
        "registers": 122,
        "smem": 34316,
        "regions": {
            "mma": 30.12,
            "load": 19.5,
            "store": 43.0,
            "stage": 40,
            "cta": 1274,
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
