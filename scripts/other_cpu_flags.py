"""Print the CPU flags of the kind of CPU this one is not, for ``STRATUS_CPU_FLAGS``.

``make test`` runs the precision-sensitive integration tests a second time as the other
kind of CPU, so both precision choices are served and checked on every machine: on an
AVX2-only CPU (FP32 everywhere) as a current Xeon with AVX-512 VNNI/BF16/FP16 and AMX (INT8
devices and edge, FP16 cloud); on such a Xeon, or any CPU with native INT8 or FP16, as an
AVX2-only one. What OpenVINO's plugin itself does (its kernels, its KV cache) still follows
the real CPU; only the variant choice moves.
"""

from __future__ import annotations

from typing import Final

from stratus.families.cpu import this_hardware

AVX512_AMX: Final = "avx512f,avx512_vnni,avx512_bf16,avx512_fp16,amx_int8,amx_bf16"
AVX2_ONLY: Final = "avx2,fma,f16c"


def other_kind() -> str:
    return AVX2_ONLY if this_hardware().precisions != {"FP32"} else AVX512_AMX


if __name__ == "__main__":
    print(other_kind())
