"""The one compiled piece of hpcft: the streaming-store copy kernel (hpcft/store/_ntcopy.c), built by
`pip install` as an optional extension. Without a working C compiler the install still succeeds, says so
on stderr (`pip install -v` shows it), and copies use memcpy (hpcft/store/ntcopy.py warns once)."""
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNEL = "hpcft.store._ntcopy"


class BuildKernel(build_ext):
    """build_ext whose failure to build the kernel is a warning naming the fix, not an install error."""

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # no compiler, a failing one, a missing header: all end the same way
            print(f"WARNING: hpcft could not build its streaming-store copy kernel ({type(exc).__name__}: {exc}); "
                  "snapshots and restores will copy with memcpy (same bytes, slower). To build it, install a "
                  "C compiler (e.g. gcc) and reinstall hpcft.", file=sys.stderr)


# -O3 named here: a CFLAGS in the environment (a site's compiler module, a Spack environment) replaces Python's own
# flags, optimisation included, and the kernel built at -O0 copied at a quarter of its speed (2-core Xeon VM)
setup(ext_modules=[Extension(KERNEL, ["hpcft/store/_ntcopy.c"], optional=True, extra_compile_args=["-O3"])],
      cmdclass={"build_ext": BuildKernel})
