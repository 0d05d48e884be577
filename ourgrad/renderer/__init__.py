"""Renderers turn a kernel's UOps into source text for one language. See cstyle.py.

A renderer also carries what the optimizer asks of its device. A GPU's facts (`GpuFacts`: multiprocessors, resident
threads and registers per multiprocessor, shared memory per block) come from the device where it is open
(runtime/ops_cuda.py reads them from the driver); the facts assumed where no device says them are the two below, and
nowhere else.
"""
from __future__ import annotations

from dataclasses import dataclass

from ourgrad.codegen.uops import UOp
from ourgrad.dtype import DType, dtypes


@dataclass(frozen=True)
class GpuFacts:
  """What the optimizer asks of a GPU (the Renderer fields of the same names)."""
  multiprocessors: int               # blocks' processors running at once (CUDA's SMs)
  threads_per_multiprocessor: int    # threads one multiprocessor keeps resident
  registers_per_multiprocessor: int  # 32-bit registers of one multiprocessor's file (its resident threads share them)
  dynamic_local_memory_bytes: int    # shared memory one block may use (dynamic, opted into)


# a CUDA renderer built without its device (NVRTC checks, the PYTHON device's EMULATE=CUDA, extra/tools) is taken for
# an H100 SXM
ASSUMED_CUDA_GPU = GpuFacts(multiprocessors=132, threads_per_multiprocessor=2048, registers_per_multiprocessor=65536,
                            dynamic_local_memory_bytes=227 * 1024)
# a renderer with thread blocks that knows no multiprocessors (the PYTHON interpreter, OpenCL) is taken for this GPU
# where a decision needs a count (codegen/opt/split_reduce.py); its other decisions treat the count as unknown
ASSUMED_THREAD_BLOCK_GPU = GpuFacts(multiprocessors=128, threads_per_multiprocessor=2048,
                                    registers_per_multiprocessor=65536, dynamic_local_memory_bytes=0)


class Renderer:
  """What the optimizer needs to know about the target, and `render(name, uops) -> source`."""
  device: str = ""
  has_threads: bool = False       # GPU-style thread indices (SPECIAL) instead of loops for global axes
  max_threads: int = 1            # threads per block (workgroup)
  has_local: bool = False         # block-shared local memory and barriers (DEFINE_LOCAL, BARRIER): GROUP opts need it
  local_memory_bytes: int = 0     # local memory a block may use
  multiprocessors: int = 0        # blocks' processors running at once (CUDA's SMs); 0: unknown (not a GPU)
  threads_per_multiprocessor: int = 0   # threads one multiprocessor keeps resident (CUDA: 2048); 0: unknown
  registers_per_multiprocessor: int = 0   # 32-bit registers of a multiprocessor (CUDA: 65536); 0: unknown
  warp_size: int = 0              # threads that WARP_REDUCE can combine with shuffles (0: no shuffles)
  vector_width: int = 0           # float32 elements one vector LOAD reads (float4: 4; 0: scalar loads only)
  # the dtypes of global buffers loaded and stored as vectors of the same bytes (vector_lanes: CUDA adds float16 and
  # bfloat16, 8 of them one 16-byte access)
  vector_dtypes: tuple[DType, ...] = (dtypes.float32,)
  byte_vector_lanes: int = 0      # bytes one vector access of a 1-byte dtype moves at most (CUDA: 4, one word); 0: any
  # bytes of memory traffic that cost about as much time as one kernel launch (launch overhead x memory bandwidth):
  # the scheduler stores an intermediate in a buffer of its own (one more launch) only when that saves more bytes
  # than this (engine/store_or_recompute.py `_store_or_recompute`). A CPU: ~5 us a call at ~10 GB/s.
  launch_bytes: int = 64 * 1024
  # bytes of memory traffic that take as long as one load waits for memory (latency x bandwidth; 0: unknown): a GPU
  # reduce with few blocks is bound by it (codegen/opt/split_reduce.py `stream_cost`)
  latency_bytes: int = 0
  # int32 atomic adds to global memory and a device-wide fence (UOps.ATOMIC_ADD, FENCE): a split reduce's last block
  # can sum its partials in the same kernel (codegen/split_finish.py); without, the partials take a second kernel
  has_block_atomics: bool = False
  # renders a one-value reduce after a kernel's own code, in its first block (a branch holding BARRIERs, uniform over
  # the block; local arrays declared at any depth): engine/ride_along.py merges such a reduce into a kernel beside it
  carries_riders: bool = False
  has_stack_arrays: bool = False  # a CPU kernel may declare per-thread arrays (DEFINE_LOCAL inside its loops)
  # per launch dimension (x, y, z): how many blocks and threads a launch may have
  global_max: tuple[int, ...] = (2**31 - 1, 65535, 65535)
  local_max: tuple[int, ...] = (1024, 1024, 64)

  def vector_lanes(self, dtype: DType) -> int:
    """Elements of `dtype` one vector access moves: the bytes of vector_width float32s (float4: 16 bytes, so 8 of a
    16-bit float); 0 where `dtype` is not loaded as vectors. The linearizer makes vectors of this width and the
    heuristics upcast by it: a warp's 16-bit accesses of 8 bytes a lane were half of what it can have in flight."""
    if self.vector_width < 2 or dtype not in self.vector_dtypes: return 0
    lanes = self.vector_width * dtypes.float32.itemsize // dtype.itemsize
    return min(lanes, self.byte_vector_lanes) if dtype.itemsize == 1 and self.byte_vector_lanes else lanes

  @property
  def runs_thread_blocks(self) -> bool:
    """A GPU-style target: thread blocks with local memory. Decisions that pay off only there (split reduces, sibling
    reduces in one kernel, a convolution's unpadded input gradient) ask this."""
    return self.has_threads and self.has_local

  # runs the fused attention kernel (codegen/attention.py, Ops.ATTENTION): CUDA sm_80+, and PYTHON with EMULATE=CUDA
  has_fused_attention: bool = False

  def set_gpu_facts(self, facts: GpuFacts) -> None:
    """Take a GPU's facts (the device's own, or one assumed above)."""
    self.multiprocessors, self.threads_per_multiprocessor = facts.multiprocessors, facts.threads_per_multiprocessor
    self.registers_per_multiprocessor = facts.registers_per_multiprocessor
    self.dynamic_local_memory_bytes = facts.dynamic_local_memory_bytes

  def render(self, name: str, uops: list[UOp]) -> str: raise NotImplementedError
