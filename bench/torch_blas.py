"""Which BLAS PyTorch runs on, for the CPU peer benchmarks (torch_*.py).

Debian's python3-torch says BLAS_INFO=generic and calls whatever libblas.so.3 the alternatives
system points at. A fresh install brings only the reference BLAS (libblas3), which is about 16x
slower than OpenBLAS on these models: a comparison against it says nothing about PyTorch. Install
libopenblas0-pthread beside python3-torch (bench/RESULTS.md).
"""

import os
import re
import sys


def blas_info(torch):
    """BLAS_INFO from torch.__config__.show(), plus the BLAS / oneDNN shared libraries mapped into
    this process. Call it after a matmul has run (the library loads lazily on some builds)."""
    parts = []
    try:
        cfg = torch.__config__.show()
        m = re.search(r"BLAS_INFO=([^,\n]+)", cfg)
        parts.append("BLAS_INFO=" + (m.group(1).strip() if m else "unknown"))
        if "USE_MKLDNN=ON" in cfg:
            parts.append("mkldnn")
    except Exception:
        pass
    try:
        libs = set()
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if re.search(r"blas|mkl_|dnnl|blis", os.path.basename(path), re.I):
                    libs.add(os.path.realpath(path))
        parts += sorted(libs)
    except OSError:
        pass
    return "; ".join(parts) or "unknown"


def warn_if_reference(info):
    """A warning on stderr when libblas.so.3, which PyTorch calls, is the reference one
    (…/blas/libblas.so.3…). Another BLAS mapped beside it (numpy's OpenBLAS) does not help."""
    if re.search(r"/blas/libblas\.so", info):
        print("warning: PyTorch runs on the reference BLAS (" + info + "); its timings are not "
              "PyTorch's. Install libopenblas0-pthread (apt) and run again.", file=sys.stderr)
