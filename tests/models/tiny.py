"""The tiny config dicts the tests build checkpoints from: ``deepinfer_fx/config/tiny.py`` (the demo
model and the eval workloads derive from the same ones), importable here as ``tiny``."""

from deepinfer_fx.config.tiny import FP8_EXPERTS, tiny_v4, tiny_v41

__all__ = ["FP8_EXPERTS", "tiny_v4", "tiny_v41"]
