"""The model: a Llama-family decoder, its weights (GGUF or safetensors), its tokenizer and chat template."""
