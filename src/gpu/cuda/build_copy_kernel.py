"""Compiles copy_kernel.cu to copy_kernel.ptx with NVRTC (no GPU needed).

    pip install nvidia-cuda-nvrtc-cu12       # NVRTC, from PyPI
    python3 src/gpu/cuda/build_copy_kernel.py

The PTX's `.version` is set to 7.0 (the kernel uses nothing newer), so the
drivers that take this path (older than CUDA 12.8) can JIT it. Check it with
ptxas (pip install nvidia-cuda-nvcc-cu12):
    ptxas -arch=sm_90 src/gpu/cuda/copy_kernel.ptx -o /dev/null
"""
import ctypes
import glob
import os
import re
import site
import sys

here = os.path.dirname(os.path.abspath(__file__))
candidates = [p for d in site.getsitepackages() + [site.getusersitepackages()]
              for p in glob.glob(os.path.join(d, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.*"))]
candidates += glob.glob(os.environ.get("NVRTC", "/nonexistent"))
if not candidates:
    sys.exit("libnvrtc not found: pip install nvidia-cuda-nvrtc-cu12 (or NVRTC=/path/libnvrtc.so)")
nvrtc = ctypes.CDLL(sorted(candidates)[0])

source = open(os.path.join(here, "copy_kernel.cu"), "rb").read()
program = ctypes.c_void_p()
check = lambda rc, what: rc == 0 or sys.exit(f"{what} failed: {rc}")
check(nvrtc.nvrtcCreateProgram(ctypes.byref(program), source, b"copy_kernel.cu", 0, None, None), "create")
options = (ctypes.c_char_p * 2)(b"-arch=compute_70", b"--std=c++11")
rc = nvrtc.nvrtcCompileProgram(program, 2, options)
size = ctypes.c_size_t()
nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
log = ctypes.create_string_buffer(size.value)
nvrtc.nvrtcGetProgramLog(program, log)
check(rc, "compile: " + log.value.decode())
nvrtc.nvrtcGetPTXSize(program, ctypes.byref(size))
ptx = ctypes.create_string_buffer(size.value)
nvrtc.nvrtcGetPTX(program, ptx)
text = re.sub(r"^\.version \d+\.\d+$", ".version 7.0", ptx.value.decode(), count=1, flags=re.M)
header = "// Generated from copy_kernel.cu by build_copy_kernel.py (NVRTC, compute_70, .version 7.0).\n"
open(os.path.join(here, "copy_kernel.ptx"), "w").write(header + text)
print(f"wrote copy_kernel.ptx ({len(text)} bytes)")
