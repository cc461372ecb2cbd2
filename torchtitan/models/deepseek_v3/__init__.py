"""DeepSeek-V3 / Kimi K2 (multi-head latent attention, DeepSeekMoE): model math so far; the
flavors, Hugging Face adapter, parallel plans and registration come with issue 33's next steps."""

from torchtitan.models.deepseek_v3.model import DeepSeekV3Model, DeepSeekV3ModelArgs

__all__ = ["DeepSeekV3Model", "DeepSeekV3ModelArgs"]
