"""The simplest complete training loop: a two-layer perceptron learns MNIST with SGD. Read it top to bottom.

    python examples/mlp.py          # a minute or two; prints the loss every 100 steps, then ~96% test accuracy

docs/training.md walks through it line by line.
"""
import numpy as np

from ourgrad import Tensor
from ourgrad.nn import Linear
from ourgrad.nn.datasets import mnist
from ourgrad.nn.losses import cross_entropy
from ourgrad.nn.optim import SGD
from ourgrad.nn.state import get_parameters

# The data: 60000 training and 10000 test images (uint8, shape (N, 1, 28, 28)) with their labels 0..9 (int32).
# We keep them in numpy, flattened to 784 pixels scaled to [0, 1], and cut minibatches out of them with numpy.
X_train, Y_train, X_test, Y_test = (t.numpy() for t in mnist())
X_train, X_test = X_train.reshape(-1, 784) / np.float32(255), X_test.reshape(-1, 784) / np.float32(255)


class MLP:
  """784 pixels -> 128 hidden units (relu) -> 10 scores, one per digit. A model is any object holding tensors."""
  def __init__(self):
    self.hidden, self.out = Linear(784, 128), Linear(128, 10)

  def __call__(self, x: Tensor) -> Tensor: return self.out(self.hidden(x).relu())


Tensor.manual_seed(0)                                      # the same initial weights on every run
model = MLP()
optimizer = SGD(get_parameters(model), lr=0.1, momentum=0.9)  # get_parameters finds the 4 weight tensors
rng = np.random.default_rng(0)
for step in range(600):
  batch = rng.integers(0, len(X_train), size=128)          # 128 random training images
  x, y = Tensor(X_train[batch]), Tensor(Y_train[batch])
  optimizer.zero_grad()                                    # forget the last step's gradients
  loss = cross_entropy(model(x), y)                        # lazy: this only builds a graph, nothing runs yet
  loss.backward()                                          # a lazy graph of d(loss)/d(weight) for every weight
  loss.realize()                                           # compute the loss now, while the weights are the old ones
  optimizer.step()                                         # compute the gradients and update the weights in place
  if step % 100 == 0: print(f"step {step:4d}  loss {loss.item():.3f}")

# Test: one batch of all 10000 images. no_grad: no backward graph is recorded for these ops.
with Tensor.no_grad_context():
  predictions = model(Tensor(X_test)).argmax(axis=1).numpy()
print(f"test accuracy: {(predictions == Y_test).mean() * 100:.2f}%")
