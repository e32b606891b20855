"""The models' linear layer: ``nn.Linear`` with the CPU decode kernel for a few rows.

A decode step multiplies every weight matrix by one row per running request, so its time is the
time to read the weights. At one to four rows, oneDNN's bfloat16 path reads them at 60-80% of
the speed of ``fused.linear`` (``cpu_ops.cpp``), and MKL's float32 path at two to sixteen rows
at a quarter to a third of it. Batch-1 decode of the 500M benchmark model went from 14 to 35
tokens/s in bfloat16 and from 7.5 to 20 in float32 with it.
More rows than ``MAX_ROWS`` go to torch, whose GEMMs are compute-efficient there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from foudre.layers import fused

# the most rows that the kernel takes, by dtype: where it stays faster than torch's GEMM here
MAX_ROWS = {torch.float32: 16, torch.bfloat16: 4}


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
