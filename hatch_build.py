"""The package's build hook (hatchling): the host kernels compiled with the package.

For a wheel, `offload_eqx/_host/kernels/compile.py` builds each kernel into a temporary folder
whose files the wheel carries into `offload_eqx/_host/kernels/`, and the wheel is tagged for
this platform. For an editable install (`pip install -e .`) it builds them into the
source tree, where the package runs from. A kernel that cannot be built (no C++
compiler, one that hangs, or a library this machine cannot load) fails no install: its
record says why, and the update runs as XLA compiles it.
"""

import importlib.util
import shutil
import tempfile
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

ROOT = Path(__file__).parent
KERNELS = ROOT / "offload_eqx" / "_host" / "kernels"


def _compile_module():
    """`compile.py` by its path: the package's dependencies are not installed here."""
    spec = importlib.util.spec_from_file_location("offload_eqx_compile", KERNELS / "compile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class KernelBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name != "wheel":
            return
        compile_module = _compile_module()
        if version == "editable":
            manifest = compile_module.build_into(KERNELS)
        else:
            folder = Path(tempfile.mkdtemp(prefix="offload_eqx-kernels-"))
            self._built = folder  # removed once the wheel holds its files (`finalize`)
            manifest = compile_module.build_into(folder)
            for path in folder.iterdir():
                build_data["force_include"][str(path)] = f"offload_eqx/_host/kernels/{path.name}"
            build_data["pure_python"] = False
            build_data["infer_tag"] = True
        for name, entry in manifest["kernels"].items():
            if "error" in entry:
                self.app.display_warning(
                    f"offload_eqx: host kernel {name!r} not built ({entry['error']}); the "
                    "optimizer update on the host runs as XLA compiles it"
                )

    def finalize(self, version: str, build_data: dict, artifact_path: str) -> None:
        built = getattr(self, "_built", None)
        if built is not None:
            shutil.rmtree(built, ignore_errors=True)
