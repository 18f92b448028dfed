"""The base layer: exception types, the one table formatter, the planners' option
checks and progress lines, and what each JAX primitive means to the plan and the audit.

May import nothing of the package; every other layer may import it.
"""
