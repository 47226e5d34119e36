"""Installing builds the CUDA library with build.py (nvcc); without nvcc the install still
succeeds and the runtime reports that only the CPU path is available."""
import importlib.util
import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        spec = importlib.util.spec_from_file_location("onegraph_build", os.path.join(HERE, "build.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if getattr(self, "editable_mode", False):
            out_dir = os.path.join(HERE, "runtime", "_lib")
        else:
            out_dir = os.path.join(self.build_lib, "onegraph", "_lib")
        module.build_library(out_dir)


setup(cmdclass={"build_py": BuildPyWithLibrary})
