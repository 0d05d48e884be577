"""ourgrad: a small, fast, hackable lazy-tensor deep-learning library.

    from ourgrad import Tensor, dtypes
    x = Tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    (x @ x).relu().sum().backward()
"""
from ourgrad.device import Device
from ourgrad.dtype import DType, dtypes
from ourgrad.engine.profile import profile
from ourgrad.helpers import GlobalCounters, get_float32_matmul_precision, set_float32_matmul_precision
from ourgrad.tensor import Tensor, no_grad
from ourgrad.engine.jit import TinyJit  # noqa: E402 (after Tensor, which it wraps)

__all__ = ["Tensor", "TinyJit", "dtypes", "DType", "Device", "GlobalCounters", "no_grad", "profile",
           "set_float32_matmul_precision", "get_float32_matmul_precision"]
__version__ = "0.1.0"
