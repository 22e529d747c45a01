"""GPU facts: vendor figures (SXM parts, dense bf16 without sparsity) and, where one was measured on such a
GPU, a large bf16 matmul's rate, the roof that issue 19 quotes MFU against. Prices change by region and by
the hour, so they are data (target.py reads them), not code.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeloop.steps.errors import MoeloopError

MIB = 1 << 20


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int  # what nvidia-smi reports as the total
    bf16_dense_flops: float  # the datasheet's dense bf16 peak
    measured_matmul_flops: float | None  # a large bf16 matmul measured on this GPU, None where not measured

    @property
    def matmul_flops(self) -> float:
        """The roof for MFU: the measured matmul where there is one, else the datasheet."""
        return self.measured_matmul_flops or self.bf16_dense_flops


GPUS = {
    "H100": GPU("H100", 81559 * MIB, 989.4e12, None),
    # 790 TFLOP/s: a dense bf16 8192^3 matmul on one H200, 789-806 in benchmarks/moe_h200.md's runs.
    "H200": GPU("H200", 143771 * MIB, 989.4e12, 790e12),
}


def gpu(name: str) -> GPU:
    if name not in GPUS:
        raise MoeloopError(f"GPU type {name!r} is not in the table ({', '.join(GPUS)})")
    return GPUS[name]
