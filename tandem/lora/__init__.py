"""Multi-LoRA: many PEFT adapters on one base model, side by side in one batch."""
