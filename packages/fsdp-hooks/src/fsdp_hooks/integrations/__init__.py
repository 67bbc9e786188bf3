"""Entry points for other frameworks: Megatron-Core's adapters and Hugging Face models."""
