"""A first look at ourgrad: lazy tensors, fused kernels and autograd.

Run `DEBUG=2 python examples/quickstart.py` to see each kernel launched, DEBUG=4 to read its C source.
"""
import numpy as np

from ourgrad import GlobalCounters, Tensor

x = Tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], requires_grad=True)
w = Tensor.randn(3, 4, requires_grad=True)

# nothing runs yet: these lines only build a lazy graph
log_probs = (x @ w).tanh().log_softmax(-1)
loss = -log_probs[:, 0].mean()        # the negative log-likelihood of class 0 (a softmax's sum would be constant)

GlobalCounters.reset()
print("loss:", loss.item())           # item() needs the value: schedule, generate C, compile, run
print("kernels for the forward pass:", GlobalCounters.kernel_count)

loss.backward()                       # the backward graph is lazy too
print("dloss/dx:", x.grad)           # printed like PyTorch: tensor([[...]])

a = Tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
print("a[1:, ::2] =\n", a[1:, ::2].numpy())          # views: no copy until needed
print("fused elementwise + reduce:", ((a * 2 + 1).exp().log() - 1).sum(axis=1).numpy())
