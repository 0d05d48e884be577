"""TinyJit given a tensor sharded over several devices (a MultiLazyBuffer): a JitError naming the input, on the
first call and after a capture of single-device inputs (the replay swaps one buffer per input, which a sharded input
does not have)."""
import numpy as np
import pytest

from ourgrad import Tensor, TinyJit
from ourgrad.errors import JitError

SHARDS = ("CLANG:0", "CLANG:1")


def test_sharded_input_is_a_jit_error_naming_it():
  @TinyJit
  def double(scale, x): return (x * scale).realize()
  x = Tensor(np.ones((4, 4), np.float32)).shard(SHARDS, axis=0)
  for _ in range(2):   # every call, not only the first: nothing was captured
    with pytest.raises(JitError, match=r"input x is sharded"):
      double(2.0, x)
  assert double.captured is None


def test_sharded_input_after_a_capture_is_a_jit_error():
  @TinyJit
  def double(x): return (x * 2).realize()
  for _ in range(3): double(Tensor(np.ones((4, 4), np.float32)))
  assert double.captured is not None
  with pytest.raises(JitError, match=r"input x is sharded"):
    double(Tensor(np.ones((4, 4), np.float32)).shard(SHARDS, axis=0))
  np.testing.assert_allclose(double(Tensor(np.full((4, 4), 3, np.float32))).numpy(), np.full((4, 4), 6))
