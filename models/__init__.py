"""Models: Hugging Face config parsing, safetensors loading with TP slicing, layers and model families."""
