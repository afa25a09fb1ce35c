"""Engine assembly, once: ``build_engine(deployment | model dir, policy, executor kind, options)``."""

from tailserve.assemble.build import EXECUTOR_KINDS, BuildOptions, BuiltEngine, ExecutorKind, build_engine

__all__ = ["EXECUTOR_KINDS", "BuildOptions", "BuiltEngine", "ExecutorKind", "build_engine"]
