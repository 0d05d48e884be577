from setuptools import find_packages, setup

setup(
  name="ourgrad",
  version="0.1.0",
  description="A small, fast, hackable lazy-tensor deep-learning library",
  long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
  long_description_content_type="text/markdown",
  packages=find_packages(include=["ourgrad", "ourgrad.*"]),
  python_requires=">=3.10",
  install_requires=["numpy"],
  extras_require={
    "testing": ["pytest", "pytest-xdist", "hypothesis", "ruff", "torch==2.13.0", "safetensors", "tqdm"],
    "examples": ["tqdm"],  # progress bars in examples/
    "llvm": ["llvmlite"],
    "opencl": ["pyopencl[pocl]"],
    # NVRTC compiles CUDA without a GPU; cuda-python's driver bindings need one (and its driver) to run kernels.
    # NCCL (collectives over several GPUs, ourgrad/distributed/) is a 305 MB wheel: kept out of "testing"/CI
    "cuda": ["cuda-python", "nvidia-cuda-nvrtc", "nvidia-nccl-cu13"],
  },
)
