"""How the CLANG device turns a kernel's object file into a shared object, and loads it.

The C compiler's driver links a shared object with its C runtime: start files, libc, libm, the OpenMP runtime
(libgomp or libomp), libgcc. Finding and reading those libraries was ~25 of the ~70 ms of CPU a small kernel took
with gcc 12 (the compile proper, cc1 and as, ~45). A kernel needs none of them at link time, only their symbols when
it loads. So each kernel is compiled to an object file (`cc -c`) and linked alone (`ld -shared kernel.o libgcc.a`,
~5 ms): the compiler's own helper archive (libgcc's float16 conversions where the target has no F16C, 128-bit
divisions) is linked in, everything else stays an undefined symbol.

Those symbols come from the *C runtime library*: a shared object with no code of its own, linked once per toolchain
by the driver exactly as it links a kernel (its flags, -fopenmp, -lm), every library recorded as needed, and loaded
RTLD_GLOBAL before the first kernel. Its needed libraries join the process's global scope, where the dynamic linker
resolves every kernel's undefined symbols when the kernel loads (RTLD_NOW). A symbol no loaded library has is a
DeviceError naming it.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import tempfile
import threading
from typing import Callable

from ourgrad.errors import DeviceError

# the C runtime library's source: nothing but a name (the libraries it needs are what counts)
RUNTIME_SOURCE = "/* ourgrad: the C runtime of the CLANG device's kernels (runtime/host_link.py) */\n" \
                 "int ourgrad_c_runtime_marker(void) { return 1; }\n"
# every library on the driver's link line is recorded as needed, whether or not the runtime library uses it (gcc on
# Debian and Ubuntu links --as-needed by default, which would record none)
RUNTIME_LINK_FLAGS = ["-Wl,--no-as-needed"]


def driver_query(compiler: str, option: str) -> str:
  """What the compiler driver prints for a -print-* option (the path of a program or library it would use)."""
  result = subprocess.run([compiler, option], capture_output=True, text=True)
  return result.stdout.strip() if result.returncode == 0 else ""


class KernelLinker:
  """Links one kernel's object file into a shared object without the C runtime's libraries (see the module's
  docstring): with the linker the driver runs, or, where the driver names none this process can find, with the
  driver itself and -nostdlib (a few ms more)."""

  def __init__(self, compiler: str):
    self.compiler = compiler
    linker = driver_query(compiler, "-print-prog-name=ld")
    self.linker = shutil.which(linker) if linker else None
    # libgcc.a (gcc, and clang with its default runtime) or compiler-rt's builtins archive; clang prints its path
    # even where the file is missing, so only a file that exists is linked
    helpers = driver_query(compiler, "-print-libgcc-file-name")
    self.helper_archives = [helpers] if helpers and os.path.isfile(helpers) else []

  @property
  def key(self) -> str:
    """What the shared objects depend on besides the compiler: the linker and the helper archive."""
    return f"link {self.linker or 'driver -nostdlib'} {' '.join(self.helper_archives)}"

  def command(self, object_path: str, library_path: str) -> list[str]:
    if self.linker is not None:
      return [self.linker, "-shared", object_path, *self.helper_archives, "-o", library_path]
    return [self.compiler, "-shared", "-nostdlib", object_path, *self.helper_archives, "-o", library_path]


_UNDEFINED_SYMBOL = re.compile(r"undefined symbol: (\S+)")


def load_library(library: bytes, what: str, mode: int = ctypes.DEFAULT_MODE) -> ctypes.CDLL:
  """Load a shared object from its bytes (through a temporary file, deleted once loaded). A symbol that no library
  in the process defines is a DeviceError naming it and `what` needed it."""
  with tempfile.NamedTemporaryFile(suffix=".so", delete=False) as library_file:
    library_file.write(library)
    path = library_file.name
  try:
    return ctypes.CDLL(path, mode=mode)   # ctypes adds RTLD_NOW: every symbol is resolved here, not at a call
  except OSError as error:
    missing = _UNDEFINED_SYMBOL.search(str(error))
    if missing is None: raise
    raise DeviceError(f"{what} needs the symbol {missing.group(1)!r}, which no library loaded in this process "
                      f"defines (the C runtime library links the C compiler's libm and OpenMP runtime: a function "
                      f"outside them cannot be called from a kernel)") from None
  finally:
    os.unlink(path)


_RUNTIMES: dict[str, ctypes.CDLL] = {}   # toolchain -> its C runtime library, loaded (never unloaded)
_RUNTIMES_LOCK = threading.Lock()


def ensure_c_runtime(toolchain: str, build: Callable[[], bytes]) -> None:
  """Load the C runtime library of `toolchain` RTLD_GLOBAL (see the module's docstring), built by `build`, once per
  process and toolchain: before the first kernel of that toolchain loads."""
  if toolchain in _RUNTIMES: return
  with _RUNTIMES_LOCK:
    if toolchain not in _RUNTIMES:
      _RUNTIMES[toolchain] = load_library(build(), "the C runtime library", mode=ctypes.RTLD_GLOBAL)
