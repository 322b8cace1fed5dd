"""Model configuration: ``ModelConfig`` (``model.py``), parsed from a ``config.json`` in either
spelling by ``parse.py`` (V4.1's composite config and the drafter fields: ``v41.py``; the vision
tower: ``vision.py``), with the field readers of ``fields.py``; the released configs as package
data (``releases.py``, ``released/*.json``)."""

from .fields import ConfigError
from .model import V41, ModelConfig, Yarn
from .parse import config_from_dict, load_config
from .releases import RELEASED, released_config
from .vision import VisionConfig

__all__ = [
    "RELEASED",
    "V41",
    "ConfigError",
    "ModelConfig",
    "VisionConfig",
    "Yarn",
    "config_from_dict",
    "load_config",
    "released_config",
]
