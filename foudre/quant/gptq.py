"""GPTQ (Frantar et al., 2022): quantize columns one at a time, spreading each column's rounding
error onto the not-yet-quantized columns through the inverse Hessian of the layer's inputs.

``H = 2 X^T X / n`` (damped by ``damp * mean(diag H)``); columns go in blocks of ``block_size``
whose errors are propagated to later blocks in one matmul ("lazy batch updates"). 4 bits uses
asymmetric group scales fitted on the error-updated weights as each group begins; 8 bits uses
per-row symmetric scales fitted on the original weights.
"""

from __future__ import annotations

import torch

from foudre.quant.packing import int4_params, pad_columns, padded_k


def hessian(x: torch.Tensor) -> torch.Tensor:
    """``2 X^T X / n`` in float64-accumulated float32, for inputs ``x`` ``[n, K]``."""
    x = x.double()
    return (2.0 / x.shape[0] * (x.t() @ x)).float()


def gptq_quantize(
    w: torch.Tensor,
    h: torch.Tensor,
    bits: int,
    group_size: int | None,
    damp: float = 0.01,
    block_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize ``w`` ``[N, K]`` given the Hessian ``h`` ``[K, K]`` of its inputs.

    Returns the codes in the layout ``QuantLinear.from_codes`` takes: for 8 bits int8 ``[N, K]``
    and scales ``[N]`` (zeros None); for 4 bits uint8 codes ``[N, Kp]``, scales and zeros
    ``[N, Kp / G]``. Columns that never see a non-zero input are quantized as zeros.
    """
    n, k = w.shape
    if bits == 4:
        assert group_size is not None
        kp = padded_k(k, group_size)
        block_size = max(block_size // group_size, 1) * group_size  # groups never straddle blocks
    else:
        kp = k
    W = pad_columns(w.float().clone(), kp)
    H = torch.zeros(kp, kp, dtype=torch.float32)
    H[:k, :k] = h.float()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += damp * torch.mean(torch.diag(H)) * torch.eye(kp)
    L = torch.linalg.cholesky(H.double())
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True).float()

    Q = torch.zeros(n, kp, dtype=torch.float32)
    if bits == 8:
        scales8 = (W.abs().amax(dim=1) / 127.0).clamp(min=1e-10)
        ngroups = 0
    else:
        assert group_size is not None
        ngroups = kp // group_size
        scales4 = torch.zeros(n, ngroups)
        zeros4 = torch.zeros(n, ngroups)
    for i1 in range(0, kp, block_size):
        i2 = min(i1 + block_size, kp)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            wcol = W1[:, i]
            if bits == 8:
                q = torch.round(wcol / scales8).clamp(-128, 127)
                Q[:, col] = q
                deq = q * scales8
            else:
                assert group_size is not None
                gi = col // group_size
                if col % group_size == 0:
                    s, z = int4_params(W1[:, i : i + group_size], group_size)
                    scales4[:, gi], zeros4[:, gi] = s[:, 0], z[:, 0]
                s, z = scales4[:, gi], zeros4[:, gi]
                q = (torch.round(wcol / s) + z).clamp(0, 15)
                Q[:, col] = q
                deq = (q - z) * s
            err = (wcol - deq) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    if bits == 8:
        return Q.to(torch.int8), scales8, None
    return Q.to(torch.uint8), scales4, zeros4
