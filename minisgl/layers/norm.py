"""RMSNorm, computed in fp32 like the HF reference: on CUDA in one fused Triton kernel, on CPU in
fp32 through the CPU kernels, elsewhere in torch ops (`rms_norm`, what both must match)."""

import torch
from torch import Tensor, nn

from minisgl.kernels.gpu import layer_kernels
from minisgl.layers.linear import frozen


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim in torch ops: in fp32 like the HF reference, then the result
    in x's dtype times the weight."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = frozen(torch.ones(size))
        self.kernels = layer_kernels(self.weight.device, self.weight.dtype)

    def forward(self, x: Tensor) -> Tensor:
        if self.kernels is not None and x.dim() == 2:
            return self.kernels.rmsnorm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def forward_residual(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(norm(x + residual), x + residual): a pre-norm decoder's residual add and norm in
        one pass. `residual` may be updated in place and returned: callers hand it over."""
        if self.kernels is not None and x.dim() == 2 and residual.is_contiguous():
            return self.kernels.rmsnorm(x, self.weight, self.eps, residual), residual
        residual = x + residual
        return rms_norm(residual, self.weight, self.eps), residual
