"""Loss functions with torch.nn.functional's names: each is the Tensor method of ourgrad/tensor_nn.py (where the
implementations and their conventions are described), so `losses.cross_entropy(logits, target)` is
`logits.cross_entropy(target)`.
"""
from __future__ import annotations

from ourgrad.tensor import Tensor
from ourgrad.tensor_nn import REDUCTIONS

__all__ = ["REDUCTIONS", "cross_entropy", "nll_loss", "sparse_categorical_crossentropy", "binary_cross_entropy",
           "binary_cross_entropy_with_logits", "mse_loss"]

cross_entropy = Tensor.cross_entropy
nll_loss = Tensor.nll_loss
sparse_categorical_crossentropy = Tensor.sparse_categorical_crossentropy
binary_cross_entropy = Tensor.binary_cross_entropy
binary_cross_entropy_with_logits = Tensor.binary_cross_entropy_with_logits
mse_loss = Tensor.mse_loss
