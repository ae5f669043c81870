"""Builds torchcollx._C. CUDA kernels are compiled when torch is a CUDA build
and a CUDA toolkit (nvcc + headers) is found; otherwise a CPU-only build.

    pip install --no-build-isolation -e .              # the source tree (make build)
    pip wheel --no-build-isolation --no-deps -w dist . # a wheel (make wheel)

The extension is tied to the torch it is built against, so the version's
local tag names that torch ("0.2.0+torch2.14.1.cu130"), the wheel requires
exactly that release, and torchcollx/_build.py records it for the import's
check (torchcollx/__init__.py).
"""
import glob
import os
import shutil

from setuptools import setup


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

RELEASE = "0.2.0"
torch_release = torch.__version__.split("+")[0]
torch_variant = "cu" + torch.version.cuda.replace(".", "") if torch.version.cuda else "cpu"
version = f"{RELEASE}+torch{torch_release}.{torch_variant}"
with open(os.path.join(ROOT, "torchcollx", "_build.py"), "w") as f:
    f.write(f'"""Written by setup.py: what this build of torchcollx._C was built against."""\n'
            f"VERSION = {version!r}\n"
            f"TORCH_VERSION = {torch.__version__!r}\n")

setup(
    version=version,
    install_requires=[f"torch=={torch_release}"],
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
