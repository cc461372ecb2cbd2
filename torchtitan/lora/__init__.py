"""LoRA: low-rank adapters on a model's linear layers (see docs/finetuning.md)."""
