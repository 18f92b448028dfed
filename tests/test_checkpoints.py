"""State restored straight into planned memory (issue 18): `ox.abstract` as the target,
Orbax checkpoints (`ox.save_checkpoint` / `ox.restore_checkpoint`) and Equinox files
(`ox.tree_deserialise_leaves`), restored in a new process and trained on with the losses
of a run that was never interrupted, bit for bit."""

import json
import os
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import scanned_model

import offload_eqx as ox

HERE = Path(__file__).parent
WORKER = HERE / "_checkpoint_worker.py"
WORKER_TIMEOUT = 300


def _arrays(model):
    return eqx.filter(model, eqx.is_array)


def _optimizer():
    return ox.offload_optimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)))


def _state(strategy="hybrid"):
    opt = _optimizer()
    model = ox.place(scanned_model(jax.random.key(0)), strategy)
    return model, ox.place(opt.init(eqx.filter(model, eqx.is_array)), strategy)


def _like():
    opt = _optimizer()
    return eqx.filter_eval_shape(
        lambda: (
            scanned_model(jax.random.key(0)),
            opt.init(_arrays(scanned_model(jax.random.key(0)))),
        )
    )


# -- ox.abstract ------------------------------------------------------------------------


@pytest.mark.parametrize("concrete", [True, False], ids=["arrays", "eval_shape"])
def test_abstract_gives_each_leaf_its_planned_sharding_and_memory(concrete):
    like = _state("baseline") if concrete else _like()
    target = ox.abstract(like, "hybrid")
    plan = ox.plan(like, "hybrid")
    leaves = jax.tree.leaves(target)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert [x.sharding.memory_kind for x in leaves] == [leaf.memory for leaf in plan.leaves]
    assert [x.shape for x in leaves] == [leaf.shape for leaf in plan.leaves]
    assert target[1].inner[1][0].mu.layers.w1.sharding.memory_kind == "pinned_host"
    assert target[1].inner[1][0].count.sharding.memory_kind == "device"


def test_a_tuple_of_model_and_state_mirrors_each_state_leaf_onto_its_parameter():
    """`ox.plan((model, opt_state))` as one tree did not find Adam's `mu.layers.w1` to be
    the state of `layers.w1` (the key paths differ by the tuple's index)."""
    plan = ox.plan(_state(), "hybrid")
    mirrors = {leaf.path: leaf.mirrors for leaf in plan.leaves}
    assert mirrors["tree[1].inner[1][0].mu.layers.w1"] == "tree[0].layers.w1"
    assert mirrors["tree[1].inner[1][0].nu.layers.w2"] == "tree[0].layers.w2"


# -- restoring, in this process ----------------------------------------------------------


def _placed_as_planned(tree, like, strategy):
    planned = jax.tree.leaves(ox.abstract(like, strategy))
    for leaf, want in zip(jax.tree.leaves(eqx.filter(tree, eqx.is_array)), planned, strict=True):
        assert leaf.sharding.memory_kind == want.sharding.memory_kind
        host = want.sharding.memory_kind == "pinned_host"
        assert (jax.typeof(leaf).memory_space == jax.memory.Space.Host) == host


def test_orbax_restore_lands_in_planned_memory(tmp_path):
    state = _state()
    ox.save_checkpoint(tmp_path / "ckpt", state)
    restored = ox.restore_checkpoint(tmp_path / "ckpt", _like(), "hybrid")
    _placed_as_planned(restored, _like(), "hybrid")
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(got, want)


def test_equinox_file_is_read_into_planned_memory_never_onto_the_device(tmp_path, monkeypatch):
    """`eqx.tree_deserialise_leaves` makes every leaf a device array (`jnp.load`) first:
    18 of 19 leaves of a hybrid state ended on the device. Each host-resident leaf is
    now put straight into host memory."""
    state = _state()
    eqx.tree_serialise_leaves(tmp_path / "state.eqx", state)
    puts = []
    real = jax.device_put

    def spy(x, device=None, *args, **kwargs):
        if isinstance(x, np.ndarray) and x.size > 1:
            puts.append(getattr(device, "memory_kind", None))
        return real(x, device, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", spy)
    restored = ox.tree_deserialise_leaves(tmp_path / "state.eqx", _like(), "hybrid")
    monkeypatch.undo()
    assert puts and set(puts) == {"pinned_host"}, puts
    _placed_as_planned(restored, _like(), "hybrid")
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(got, want)


def _other_models():
    other = scanned_model(jax.random.key(0), width=8, hidden=8)
    bigger = scanned_model(jax.random.key(0), depth=4)
    return {
        "another_model": (other, _optimizer().init(_arrays(other))),
        "another_structure": other,
        "one_leaf_of_another_shape": (
            eqx.tree_at(
                lambda m: m.layers.w2, scanned_model(jax.random.key(0)), jnp.ones((3, 32, 8))
            ),
            _optimizer().init(_arrays(scanned_model(jax.random.key(0)))),
        ),
        "a_leaf_more": (bigger, _optimizer().init(_arrays(bigger))),
    }


EXPECTED = {
    "another_model": r"`like\[0\].layers.w1` is float32\[3, 16, 32\] in the checkpoint but float32\[3, 8, 8\] in `like`, the first leaf that differs",
    "another_structure": r"`like.layers.w1` (is not in the checkpoint|is float32\[3, 16, 32\] in the checkpoint)",
    "one_leaf_of_another_shape": r"`like\[0\].layers.w2` is float32\[3, 32, 16\] in the checkpoint but float32\[3, 32, 8\]",
    "a_leaf_more": r"`like\[0\].layers.w1` is float32\[3, 16, 32\] in the checkpoint but float32\[4, 16, 32\]",
}


@pytest.mark.parametrize("case", list(EXPECTED))
@pytest.mark.parametrize("fmt", ["orbax", "equinox"])
def test_a_checkpoint_of_another_model_names_the_first_leaf_that_differs(tmp_path, fmt, case):
    state = _state()
    if fmt == "orbax":
        ox.save_checkpoint(tmp_path / "ckpt", state)
        restore = lambda like: ox.restore_checkpoint(tmp_path / "ckpt", like, "hybrid")  # noqa: E731
    else:
        eqx.tree_serialise_leaves(tmp_path / "state.eqx", state)
        restore = lambda like: ox.tree_deserialise_leaves(tmp_path / "state.eqx", like, "hybrid")  # noqa: E731
    with pytest.raises(ValueError, match=EXPECTED[case]):
        restore(_other_models()[case])


def test_an_equinox_file_with_more_leaves_than_like_is_an_error(tmp_path):
    eqx.tree_serialise_leaves(tmp_path / "state.eqx", _state())
    with pytest.raises(ValueError, match=r"holds more leaves that `like` has no place for"):
        ox.tree_deserialise_leaves(tmp_path / "state.eqx", _like()[0], "hybrid")


# -- restoring in a new process -------------------------------------------------------------


def run_worker(phase, fmt, layout, directory, steps, env=None) -> dict:
    output = Path(directory) / f"{phase}.json"
    done = subprocess.run(
        [sys.executable, str(WORKER), phase, fmt, layout, str(directory), str(steps), str(output)],
        env=dict(os.environ, **(env or {})),
        capture_output=True,
        text=True,
        timeout=WORKER_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(output.read_text())


def assert_resumed_equals_straight(tmp_path, fmt, layout, env=None):
    """Train 1 step, checkpoint, restore in a new process, train 2 more: the losses and
    the final parameters equal a 3-step run bit for bit; right after the restore, before
    any step, every leaf is where the plan puts it (memory, spec, type)."""
    straight = run_worker("straight", fmt, layout, tmp_path / "straight", 3, env)
    saved = run_worker("save", fmt, layout, tmp_path / "ckpt", 1, env)
    resumed = run_worker("resume", fmt, layout, tmp_path / "ckpt", 2, env)
    assert resumed["restored"] == resumed["planned"]
    assert "pinned_host" in {memory for memory, _, _ in resumed["restored"].values()}
    assert saved["losses"] + resumed["losses"] == straight["losses"]
    assert resumed["params"] == straight["params"]
    return resumed


@pytest.mark.parametrize("fmt", ["orbax", "equinox"])
def test_resumed_in_a_new_process_equals_an_uninterrupted_run(tmp_path, fmt):
    for name in ("straight", "ckpt"):
        (tmp_path / name).mkdir(exist_ok=True)
    if fmt == "orbax":
        (tmp_path / "ckpt").rmdir()  # Orbax writes the checkpoint directory itself
    assert_resumed_equals_straight(tmp_path, fmt, "one")
