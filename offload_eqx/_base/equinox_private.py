"""Every private name of Equinox that offload_eqx uses, in one place.

Each is optional: where an Equinox release moves one, offload_eqx loses only what it
serves (said below), never an import. Checked on equinox 0.13.8 (with jax 0.10.2 and
0.12.0.1).
"""

import importlib
from typing import Any

CHECKED = ("0.13.8",)


def _optional(module_name: str, attribute: str | None, default: Any) -> Any:
    """`module_name.attribute` (the module itself for None), else `default`."""
    try:
        module = importlib.import_module(module_name)
        return module if attribute is None else getattr(module, attribute)
    except (ImportError, AttributeError):
        return default


# `eqx.clear_caches()` calls every function in this list: ours joins it, so that one call
# clears both (without it, `ox.clear_caches()` still clears ours).
cache_clears: list = _optional("equinox._caches", "cache_clears", [])
# Equinox's module of `filter_jit`: the message and stack of the last `eqx.error_if` that
# fired (`last_error_info`) and the template of its error (`_on_error_msg`), read to raise
# the `eqx.EquinoxRuntimeError` Equinox raises (without it: XLA's error, unchanged).
equinox_jit: Any = _optional("equinox._jit", None, None)
# The marker `eqx.nn.Shared` leaves in its pytree in place of a tied array (without it:
# a tied leaf is placed as any other).
SharedNode: Any = _optional("equinox.nn._shared", "SharedNode", ())
