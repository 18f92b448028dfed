"""pytest plugin: run tests under `ox.no_implicit_transfers()`.

Registered as a `pytest11` entry point, so installing offload_eqx makes both available:

- the fixture `no_implicit_transfers`: request it and the whole test body runs under the
  guard;
- the marker `@pytest.mark.no_implicit_transfers`: the same, without an argument.

The package is imported only when a test asks for the guard, so the plugin does not import
jax (or offload_eqx) before other plugins, such as jaxtyping's import hook, are set up.
"""

import pytest

MARKER = "no_implicit_transfers"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        f"{MARKER}: run the test under offload_eqx's no_implicit_transfers() guard "
        "(implicit host-to-device or device-to-device transfers are errors naming the "
        "argument).",
    )


@pytest.fixture(name="no_implicit_transfers")
def no_implicit_transfers_fixture():
    """Run the test body under `ox.no_implicit_transfers()`."""
    from offload_eqx._jit.guard import no_implicit_transfers

    with no_implicit_transfers():
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if item.get_closest_marker(MARKER) is None or MARKER in getattr(item, "fixturenames", ()):
        return (yield)
    from offload_eqx._jit.guard import no_implicit_transfers

    with no_implicit_transfers():
        return (yield)
