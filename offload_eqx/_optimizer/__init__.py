"""Optimizer state placed by the parameter it mirrors, and the update where that
state lives: `ox.offload_optimizer`, `ox.update_and_apply`, `ox.apply_updates`
(`optimizer`); the wrapped state types (`state`), the checks that a transform can run
leaf by leaf (`checks`), the delayed update's state and rule (`delayed`), the
layer-streamed update (`stream`) and the update on the host (`host`).

May import `_base` to `_trace`.
"""
