"""Model families as data: what sets each decoder family apart (registry.py), read by the config, the model,
the tensor-parallel plan, LoRA, the Hugging Face adapter and the counts."""
