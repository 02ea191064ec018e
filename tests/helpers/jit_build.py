"""A flashinfer-shaped JIT cache with a real nvcc build in it.

Layout as flashinfer writes it: <base>/.cache/flashinfer/<version>/<arch>/cached_ops/<module>/ holding
build.ninja, the *.cuda.o objects and finally <module>.so. The objects are compiled by the real nvcc for sm_121a.
One source is tiny and one is heavy (an unrolled loop that keeps cicc busy for several seconds), so with `ninja -j2`
there is a moment with one object done, one compiling and the module not linked: a build in progress.
"""

from __future__ import annotations

from pathlib import Path

KERNEL = """template <int N> __global__ void {name}(float* x, const float* y) {{
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) acc += y[threadIdx.x * N + i] * (i + 1) + __sinf(acc);
  x[threadIdx.x] = acc;
}}
template __global__ void {name}<{n}>(float*, const float*);
"""

BUILD_NINJA = """ninja_required_version = 1.3
cuda_cflags = -gencode arch=compute_121a,code=sm_121a -Xcompiler -fPIC -O2
rule cuda_compile
  command = nvcc $cuda_cflags -c $in -o $out
rule link
  command = nvcc -shared $in -o $out
build norm_small.cuda.o: cuda_compile {src}/norm_small.cu
build norm_heavy.cuda.o: cuda_compile {src}/norm_heavy.cu
build {module}.so: link norm_small.cuda.o norm_heavy.cuda.o
default {module}.so
"""


def flashinfer_module(
    home: Path, module: str = "rmsnorm", version: str = "0.2.8", arch: str = "121a", heavy_unroll: int = 2048
) -> Path:
    """Write sources and a build.ninja; return the module directory (where `ninja` is to run)."""
    src = home / "src"
    src.mkdir(parents=True, exist_ok=True)
    (src / "norm_small.cu").write_text(KERNEL.format(name="norm_small", n=16))
    (src / "norm_heavy.cu").write_text(KERNEL.format(name="norm_heavy", n=heavy_unroll))
    module_dir = home / ".cache" / "flashinfer" / version / arch / "cached_ops" / module
    module_dir.mkdir(parents=True)
    (module_dir / "build.ninja").write_text(BUILD_NINJA.format(src=src, module=module))
    return module_dir
