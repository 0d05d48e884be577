"""Every exception ourgrad raises on purpose lives here.

Each class also derives from the built-in exception a Python user would expect (ValueError for a
bad shape, TypeError for a bad dtype, IndexError for a bad axis or index), so `except ValueError`
keeps working. Shape and dtype errors are RuntimeErrors too, because PyTorch raises RuntimeError for them
("The size of tensor a (3) must match ...", "expected scalar type Float but found Half"): code and tests written
for PyTorch that catch RuntimeError catch ours. Messages name the offending shapes, dtypes, axes or devices and say
how to fix it.
"""


class OurgradError(Exception):
  """Base class of all ourgrad errors."""


class ShapeError(OurgradError, ValueError, RuntimeError):
  """Shapes that do not fit: broadcasting, reshape element counts, matmul inner dimensions."""


class AxisError(OurgradError, IndexError):
  """An axis (dimension) index outside the tensor's dimensions, or repeated."""


class IndexOutOfRangeError(OurgradError, IndexError):
  """A constant integer index outside a dimension's size."""


class DTypeError(OurgradError, TypeError, RuntimeError):
  """An operation that the given dtype(s) do not support (bitwise ops on floats, bad casts)."""


class DeviceError(OurgradError, RuntimeError):
  """Tensors on different devices mixed in one op, or a device that is not available."""


class CompileError(OurgradError, RuntimeError):
  """A generated kernel failed to compile; the message holds the source and the compiler log."""


class AutogradError(OurgradError, RuntimeError):
  """backward() called where no gradient can be computed."""


class OutOfMemoryError(OurgradError, MemoryError):
  """A device allocation failed even after freeing the allocator's cache."""


class JitError(OurgradError, RuntimeError):
  """A TinyJit function used in a way that replaying its captured kernels could not reproduce."""


class ShardingError(ShapeError):
  """Tensors sharded differently mixed in one op, or a view or reduce that would cross the shards of a sharded axis."""


class PrecisionError(OurgradError, ValueError):
  """A float32 matmul precision that is not one of set_float32_matmul_precision's names."""
