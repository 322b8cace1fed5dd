"""deepinfer_fx: offline inference engine for DeepSeek-V4-class MoE models."""
