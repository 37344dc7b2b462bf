"""Build moecc and its native extension ``moecc._C``.

The extension is plain C++17 bound with pybind11; it does not link libtorch, so one build works with any torch.
"""
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext, tmp_chdir
from setuptools import find_packages, setup

ROOT = Path(__file__).parent
CPP_SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "cpp").rglob("*.cpp"))

extension = Pybind11Extension(
    "moecc._C",
    CPP_SOURCES,
    include_dirs=["cpp"],
    cxx_std=17,
    # -fopenmp-simd honours `#pragma omp simd` (vectorised reductions) without the OpenMP runtime.
    # -fno-math-errno lets those loops call glibc's vector expf.
    extra_compile_args=["-O3", "-pthread", "-fno-strict-aliasing", "-fopenmp-simd", "-fno-math-errno"],
    extra_link_args=["-pthread"],
)

# GCC 13's generic tuning leaves a multiply-add unfused where it ends a loop-carried chain (GCC 12 fuses it), and
# decides that per function: the same source then rounds differently in two instances (a row alone or in a group;
# plain or streamed stores). Zero turns the heuristic off, so every build fuses alike and those give the same bits.
FMA_FLAG = "--param=avoid-fma-max-bits=0"


def takes_quietly(compiler, flag: str) -> bool:
    """Whether ``compiler`` compiles a trivial file with ``flag`` under -Werror (one that only warns about an
    unknown option, as clang may, does not count)."""
    try:
        from setuptools.errors import CompileError
    except ImportError:  # setuptools < 59
        from distutils.errors import CompileError

    with tmp_chdir():
        Path("flag_check.cpp").write_text("int main() { return 0; }\n", encoding="utf-8")
        try:
            compiler.compile(["flag_check.cpp"], extra_postargs=["-Werror", flag])
        except CompileError:
            return False
    return True


# Per-ISA translation units (tinyBLAS style): each file in cpp/kernels/isa/ is compiled with the flags of the ISA its
# name ends with, so the untargeted vector helpers it inlines (vector16.h) are built for that ISA, which clang
# requires. Every other file has the baseline x86-64 flags, so the module loads, and its dispatchers choose, on any
# x86-64 CPU. "avx512" is the ISA target_clones("avx512f") gives a copy (vector16.h), "avx512bf16" the one the
# AVX512-BF16 panel kernels' target attributes name.
ISA_DIR = "cpp/kernels/isa"
ISA_FLAGS = {
    "avx512": ["-mavx512f"],
    "avx512bf16": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"],
}


def isa_flags(source: str) -> list:
    """The ISA flags for ``source`` (a path as the compiler gets it): none outside ISA_DIR."""
    path = Path(source).resolve()
    if path.parent != (ROOT / ISA_DIR).resolve():
        return []
    isa = path.stem.rsplit("_", 1)[-1]
    if isa not in ISA_FLAGS:
        raise ValueError(f"{source}: files in {ISA_DIR} end with _<isa>.cpp, <isa> one of {sorted(ISA_FLAGS)}")
    return ISA_FLAGS[isa]


class BuildExt(build_ext):
    """build_ext that adds FMA_FLAG where the compiler takes it without a warning (GCC; others go without), and the
    per-file ISA flags (ISA_FLAGS)."""

    def build_extensions(self) -> None:
        if takes_quietly(self.compiler, FMA_FLAG):
            for ext in self.extensions:
                ext.extra_compile_args.append(FMA_FLAG)
        # distutils has no per-source flags; _compile (one source) is the hook numpy.distutils and others use too.
        compile_one = self.compiler._compile

        def compile_with_isa(obj, src, ext, cc_args, extra_postargs, pp_opts):
            compile_one(obj, src, ext, cc_args, list(extra_postargs) + isa_flags(src), pp_opts)

        self.compiler._compile = compile_with_isa
        super().build_extensions()


setup(
    name="moecc",
    version="0.1.0",
    description="LoRA fine-tuning of Mixture-of-Experts models whose routed experts run on the CPU",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["moecc", "moecc.*"]),
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExt},
    install_requires=[
        "torch>=2.4",
        "numpy",
        "numba",
        "transformers>=5.0",
        "peft>=0.18",
        "accelerate",
        "safetensors",
        "tqdm",
        "matplotlib",
    ],
    extras_require={"test": ["pytest", "trl>=1.16"]},
    entry_points={"console_scripts": ["moecc = moecc.cli:main"]},
)
