"""The models' linear layer: ``nn.Linear`` with the CPU kernel for decode-sized batches.

A decode step multiplies every weight matrix by one row per running request. At a few rows its
time is the time to read the weights, and ``fused.linear`` (``cpu_ops.cpp``) reads them at the
machine's matrix-vector speed, where oneDNN's bfloat16 path reads at 60-80% of it and MKL's
float32 path at two to 64 rows at a quarter to a third. Batch-1 decode of the 500M benchmark
model went from 14 to 35 tokens/s in bfloat16 and from 7.5 to 20 in float32 with it. At more
rows the kernel is bound by its multiply-adds; it stays ahead of oneDNN's bfloat16 GEMM up to
about 16 rows and of MKL's float32 GEMM to 64 (measured on this project's 2-core AVX-512 host,
all 16 layers' weights streamed from DRAM). More rows than ``MAX_ROWS`` go to torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from foudre.layers import fused

# the most rows that the kernel takes, by dtype: where it stays faster than torch's GEMM here
MAX_ROWS = {torch.float32: 64, torch.bfloat16: 16}


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (
            x.dim() == 2
            and x.shape[0] <= MAX_ROWS.get(x.dtype, 0)
            and w.is_contiguous()
            and fused.enabled(x, w, *(() if self.bias is None else (self.bias,)))
        ):
            return fused.linear(x, w, self.bias)
        return F.linear(x, w, self.bias)
