"""acco: Accumulate while you Communicate. Overlapped, ZeRO-1 sharded data-parallel training of LMs.

    from acco import DecoupledTrainer          # drop-in for transformers.Trainer
    from acco.engine import build_engine       # the engine alone, for your own loop
"""

__version__ = "0.1.0"
__all__ = ["DecoupledTrainer", "EngineConfig", "build_engine"]


def __getattr__(name):
    # Lazy: `import acco.engine` must not pull in transformers.
    if name == "DecoupledTrainer":
        from acco.trainer import DecoupledTrainer

        return DecoupledTrainer
    if name in ("EngineConfig", "build_engine"):
        import acco.engine

        return getattr(acco.engine, name)
    raise AttributeError(f"module 'acco' has no attribute {name!r}")
