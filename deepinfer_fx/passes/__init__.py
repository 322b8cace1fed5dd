"""Graph passes: the registry and per-accelerator pipelines (``manager``), the fusion passes,
graph dumps and our torch.compile backend (``compiler.make_backend``)."""

from .manager import (
    ACCELERATORS,
    ENV_DISABLE,
    GraphPass,
    Pipeline,
    build_pipeline,
    register_pass,
    registered_passes,
    resolve_disabled,
)

__all__ = [
    "ACCELERATORS",
    "ENV_DISABLE",
    "GraphPass",
    "Pipeline",
    "build_pipeline",
    "register_pass",
    "registered_passes",
    "resolve_disabled",
]
