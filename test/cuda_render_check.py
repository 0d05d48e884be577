"""CHECK_CUDA_RENDER's compile hook (wired in by test/conftest.py), in a module of its own so a test can import it:
`conftest` is not a unique module name (test/fuzz has one too)."""
import os
from typing import Any, Callable


# the id of the test running now: the check names it beside a kernel NVRTC rejects
_current_test = [""]


def _check_cuda_mode() -> str:
  """"" (no check), "test" (compile each test's kernels at its teardown) or "file" (each test file's, at its end)."""
  value = os.environ.get("CHECK_CUDA_RENDER", "")
  return "" if value in ("", "0") else "file" if value == "file" else "test"


def cuda_checking_compile(compile_for_device: Callable, renderer: Any, nvrtc_check: Any) -> Callable:
  """engine/realize.py's compile_kernel that also builds each kernel for CUDA with `renderer` and hands its source to
  `nvrtc_check` (runtime/nvrtc_check.py NvrtcCheck), then compiles it for its own device with `compile_for_device`."""
  from ourgrad.codegen.lowering import build_kernel, lower_kernel
  from ourgrad.engine import realize
  from ourgrad.ops import Ops

  def compile_and_check_cuda(kernel, device):
    if not _check_cuda_mode():  # a test may switch the check off (monkeypatch.delenv)
      return compile_for_device(kernel, device)
    # the same kind of kernel with the same default opts, built for CUDA (a one-kernel split reduce, EMULATE=CUDA, is
    # one for CUDA too; a kernel carrying a one-value reduce, codegen/ride_along.py, is built from its whole AST)
    ast = getattr(kernel, "split_ast", None) or getattr(kernel, "ride_ast", None) or kernel.ast
    cuda_kernel = build_kernel(ast, renderer)
    try:
      source = lower_kernel(cuda_kernel, renderer, realize.function_name(cuda_kernel)).source
    except AssertionError as error:   # a rider that fits the device's block but not CUDA's: check the host alone
      if ast.op is not Ops.RIDE_ALONG or "does not fit" not in str(error): raise
      cuda_kernel = build_kernel(kernel.ast, renderer)
      source = lower_kernel(cuda_kernel, renderer, realize.function_name(cuda_kernel)).source
    nvrtc_check.add(realize.function_name(cuda_kernel), source, _current_test[0])   # compiled at a teardown
    return compile_for_device(kernel, device)
  return compile_and_check_cuda
