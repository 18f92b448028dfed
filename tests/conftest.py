import os

# Before jax is imported anywhere: choose the platform (the CUDA plugin, when installed
# for deviceless compiles, otherwise probes for a driver). Strict dtype promotion is not
# switched on: optax's own Adam mixes Python floats with its int32 step count.
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_configure(config):
    config.addinivalue_line("markers", "deviceless: compiles for h100/tpu-v5p without the hardware")
    config.addinivalue_line("markers", "multidevice: needs 8 CPU devices or 2 processes")
