"""Builds torchcollx._C. CUDA kernels are compiled when torch is a CUDA build
and a CUDA toolkit (nvcc + headers) is found; otherwise a CPU-only build.

    pip install --no-build-isolation -e .
"""
import glob
import os
import shutil

from setuptools import find_packages, setup


def find_cuda_home():
    """The folder holding bin/nvcc and include/cuda_runtime.h. The user's
    CUDA_HOME wins; a wrapper script named nvcc on PATH does not fool us."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for home in candidates:
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")) and os.path.isfile(
            os.path.join(home, "include", "cuda_runtime.h")
        ):
            return home
    return None


cuda_home = find_cuda_home()
if cuda_home:
    os.environ["CUDA_HOME"] = cuda_home  # must precede the cpp_extension import

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))
core = sorted(glob.glob("csrc/core/**/*.cc", recursive=True))
glue = sorted(glob.glob("csrc/torch/*.cc"))
kernels = sorted(glob.glob("csrc/cuda/*.cu"))
use_cuda = bool(torch.version.cuda) and cuda_home is not None and bool(kernels) and (
    os.environ.get("COLLX_NO_CUDA", "0") != "1"
)

cxx_flags = ["-O3", "-Wall", "-Wno-unused-parameter"]
if use_cuda:
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"  # no GPU to ask: target the H100
    ext = CUDAExtension(
        "torchcollx._C",
        core + glue + kernels,
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=[("COLLX_WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]},
    )
else:
    ext = CppExtension(
        "torchcollx._C",
        core + glue,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": cxx_flags},
    )

setup(
    name="torchcollx",
    version="0.1.0",
    description="collx: a TCP collective backend for torch.distributed",
    packages=find_packages(include=["torchcollx", "torchcollx.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.10",
)
