"""The PYTHON device: no compiler; kernels are interpreted from their UOps with numpy.

It lets CI run the GPU-only code paths (thread blocks, local memory, barriers, `if` blocks, warp shuffles) on any
machine, and it is an executable reference for what the UOps mean (the contract in `ourgrad/codegen/uops.py`).
With `EMULATE=CUDA` the renderer reports CUDA's limits (threads per block, local memory, warp size), so the
optimizer makes exactly the kernels it makes for CUDA, and the interpreter runs them.

- `PythonRenderer` serializes a kernel's UOp list to JSON text, one UOp per line: the "source" (DEBUG=4 prints it).
- `PythonCompiler` passes that text through as bytes: there is nothing to compile.
- `PythonProgram` parses the text back (plain JSON, no eval, `parse_program`) and runs the kernel for every
  (block, thread) at once with the interpreter: runtime/uop_interpreter.py (control flow, numbers, global memory)
  and runtime/gpu_emulator.py (thread indices, local memory and barriers, warp reduces, tensor cores, asynchronous
  copies). wgmma kernels are their own program text, run by runtime/wgmma_emulator.py; fused attention kernels
  too, run by runtime/attention_emulator.py.
"""
from __future__ import annotations

import json
import math
import time
from typing import Any

import numpy as np

from ourgrad.codegen.uops import AxisType, UOp, UOps
from ourgrad.device import Compiled, Compiler, HostAllocator
from ourgrad.dtype import DType, dtypes
from ourgrad.errors import CompileError, DeviceError
from ourgrad.helpers import EMULATE
from ourgrad.shape.symbolic import Node
from ourgrad.ops import Ops
from ourgrad.renderer import ASSUMED_CUDA_GPU, Renderer
from ourgrad.renderer.cuda import CUDARenderer
from ourgrad.codegen.attention import AttentionPlan
from ourgrad.codegen.attention_grad import AttentionGradKernel
from ourgrad.runtime.attention_backward_emulator import (AttentionBackwardProgram, attention_backward_program_text,
                                                         is_attention_backward_program)
from ourgrad.runtime.attention_emulator import AttentionProgram, attention_program_text, is_attention_program
from ourgrad.runtime.gpu_emulator import GpuInterpreter
from ourgrad.runtime.uop_interpreter import Instruction, UOpProgram
from ourgrad.runtime.wgmma_emulator import WgmmaMatmul, WgmmaProgram, is_wgmma_program, wgmma_program_text

PROGRAM_FORMAT = "ourgrad-python-uops-v1"
DTYPES_BY_NAME: dict[str, DType] = {dtype.name: dtype for dtype in dtypes.all()}


# ---------------------------------------------------------------- serializing UOps (the "source")

def encode_arg(arg: Any) -> Any:
  """A UOp argument as JSON data: Ops members become {"alu": name}, non-finite floats {"float": "inf"|"-inf"|"nan"},
  tuples become lists (no other argument is a list, so decoding turns every list back into a tuple)."""
  if isinstance(arg, np.generic): arg = arg.item()
  if isinstance(arg, Ops): return {"alu": arg.name}
  if isinstance(arg, AxisType): return {"axis": arg.name}
  if arg is None or isinstance(arg, (bool, int, str)): return arg
  if isinstance(arg, float):
    if math.isfinite(arg): return arg  # json writes repr(float), which reads back to the same float
    return {"float": "nan" if math.isnan(arg) else ("inf" if arg > 0 else "-inf")}
  if isinstance(arg, tuple): return [encode_arg(item) for item in arg]
  # a symbolic launch size (SPECIAL over a Variable's range): kept as text, the launch passes the real size
  if isinstance(arg, Node): return {"symbolic": arg.render()}
  raise NotImplementedError(f"the PYTHON renderer cannot serialize a UOp argument of type {type(arg).__name__}: "
                            f"{arg!r}")


def decode_arg(data: Any) -> Any:
  """The inverse of `encode_arg`; rejects anything it did not produce."""
  if data is None or isinstance(data, (bool, int, float, str)): return data
  if isinstance(data, list): return tuple(decode_arg(item) for item in data)
  if isinstance(data, dict) and len(data) == 1:
    if "alu" in data and data["alu"] in Ops.__members__: return Ops[data["alu"]]
    if "axis" in data and data["axis"] in AxisType.__members__: return AxisType[data["axis"]]
    if "float" in data and data["float"] in ("inf", "-inf", "nan"): return float(data["float"])
    if "symbolic" in data and isinstance(data["symbolic"], str): return data["symbolic"]
  raise CompileError(f"PYTHON program: cannot decode UOp argument {data!r}")


class PythonRenderer(Renderer):
  """Renders UOps as JSON, one UOp per line: `[position, op, dtype, [source positions], arg]`.

  The text is deterministic (the compile cache keys on it) and is the whole program: the interpreter needs
  nothing else. GPU-like: global axes become block indices, LOCAL and GROUP opts become thread indices, GROUP
  partials meet in local memory. `emulate="CUDA"` takes CUDA's limits instead of its own."""
  device = "PYTHON"
  has_threads = True
  carries_riders = True   # a rider runs in the first block (engine/ride_along.py; the interpreter checks its BARRIERs)
  max_threads = 128
  has_local = True
  local_memory_bytes = 16384
  dynamic_local_memory_bytes = 16384
  warp_size = 0
  vector_width = 4
  tensor_cores: tuple = ()   # EMULATE=CUDA takes CUDA's (WMMA is interpreted as mma.sync, see Interpreter.wmma)

  has_wgmma = False   # EMULATE=CUDA_SM90: also OptOps.WGMMA (runtime/wgmma_emulator.py)

  def __init__(self, emulate: str = "") -> None:
    if emulate == "": return
    if emulate.upper() not in ("CUDA", "CUDA_SM90"):
      raise DeviceError(f"EMULATE={emulate}: the PYTHON device emulates only CUDA (CUDA_SM90: an H100, with wgmma)")
    self.has_wgmma = emulate.upper() == "CUDA_SM90"
    self.has_fused_attention = True   # runtime/attention_emulator.py
    self.set_gpu_facts(ASSUMED_CUDA_GPU)
    for limit in ("max_threads", "has_local", "local_memory_bytes", "warp_size", "vector_width", "vector_dtypes",
                  "byte_vector_lanes", "global_max", "local_max", "tensor_cores", "has_async_copy", "launch_bytes",
                  "latency_bytes", "has_block_atomics"):
      setattr(self, limit, getattr(CUDARenderer, limit))

  def render(self, name: str, uops: list[UOp]) -> str:
    position = {id(uop): index for index, uop in enumerate(uops)}
    lines = []
    for index, uop in enumerate(uops):
      srcs = [position[id(src)] for src in uop.srcs]
      entry = [index, uop.op.name, uop.dtype.name if uop.dtype is not None else None, srcs, encode_arg(uop.arg)]
      lines.append(json.dumps(entry, allow_nan=False))
    header = json.dumps({"format": PROGRAM_FORMAT, "name": name})[:-1]  # left open: the uops follow
    return header + ', "uops": [\n' + ",\n".join(lines) + "\n]}\n"

  def render_wgmma(self, name: str, plan: WgmmaMatmul, arguments: dict[str, int]) -> str:
    return wgmma_program_text(name, plan, arguments)

  def render_attention(self, name: str, plan: AttentionPlan, arguments: dict[str, int]) -> str:
    return attention_program_text(name, plan, arguments)

  def render_attention_grad(self, name: str, kernel: AttentionGradKernel) -> str:
    return attention_backward_program_text(name, kernel.plan, kernel.kernel, kernel.bindings)


class PythonCompiler(Compiler):
  """Nothing to compile: the serialized UOps are the binary."""
  cache_key = "python v1"

  def compile(self, source: str) -> bytes: return source.encode()


# ---------------------------------------------------------------- parsing the program back


def _reject_constant(name: str) -> Any:
  raise CompileError(f"PYTHON program: non-standard JSON constant {name}")


def parse_program(text: str) -> tuple[str, list[Instruction]]:
  """(kernel name, instructions) from `PythonRenderer.render` output, checking that it is well formed."""
  try:
    document = json.loads(text, parse_constant=_reject_constant)
  except json.JSONDecodeError as error:
    raise CompileError(f"PYTHON program is not valid JSON: {error}") from None
  if not isinstance(document, dict) or document.get("format") != PROGRAM_FORMAT:
    raise CompileError(f"PYTHON program: expected format {PROGRAM_FORMAT!r}")
  instructions: list[Instruction] = []
  for index, entry in enumerate(document.get("uops", [])):
    if not (isinstance(entry, list) and len(entry) == 5 and entry[0] == index):
      raise CompileError(f"PYTHON program: malformed uop {index}: {entry!r}")
    _, op_name, dtype_name, srcs, arg = entry
    if op_name not in UOps.__members__: raise CompileError(f"PYTHON program: unknown uop {op_name!r}")
    if dtype_name is not None and dtype_name not in DTYPES_BY_NAME:
      raise CompileError(f"PYTHON program: unknown dtype {dtype_name!r}")
    if not (isinstance(srcs, list) and all(isinstance(src, int) and 0 <= src < index for src in srcs)):
      raise CompileError(f"PYTHON program: uop {index} has sources {srcs!r} that are not earlier uops")
    dtype = DTYPES_BY_NAME[dtype_name] if dtype_name is not None else None
    instructions.append(Instruction(UOps[op_name], dtype, tuple(srcs), decode_arg(arg)))
  return str(document.get("name", "")), instructions


# ---------------------------------------------------------------- running it

class PythonProgram(UOpProgram):
  """A kernel's UOps, run for all threads at once with numpy. Called like any device program:
  `program(*buffers, global_size=(bx, by, bz), local_size=(tx, ty, tz), wait=False)`."""

  def __init__(self, name: str, binary: bytes):
    super().__init__(name, parse_program(binary.decode())[1])

  def __call__(self, *buffers: np.ndarray, global_size: tuple[int, ...] = (1, 1, 1),
               local_size: tuple[int, ...] = (1, 1, 1), wait: bool = False, vals: tuple[int, ...] = ()) -> float | None:
    start = time.perf_counter()
    with np.errstate(all="ignore"):  # wraparound, inf and NaN are intended results here, not accidents
      interpreter = GpuInterpreter(self, buffers, tuple(global_size), tuple(local_size))
      # vals: the symbolic Variables' values, one per DEFINE_VAR in program order (the kernel's int arguments)
      var_names = [instruction.arg[0] for instruction in self.instructions if instruction.op is UOps.DEFINE_VAR]
      interpreter.var_values = dict(zip(var_names, vals))
      interpreter.run()
    return time.perf_counter() - start if wait else None


def load_program(name: str, binary: bytes) -> (PythonProgram | WgmmaProgram | AttentionProgram |
                                               AttentionBackwardProgram):
  if is_attention_program(binary): return AttentionProgram(name, binary)
  if is_attention_backward_program(binary): return AttentionBackwardProgram(name, binary)
  return WgmmaProgram(name, binary) if is_wgmma_program(binary) else PythonProgram(name, binary)


def create_device(name: str) -> Compiled:
  return Compiled(name, HostAllocator(), PythonRenderer(EMULATE.value), PythonCompiler(), load_program)
