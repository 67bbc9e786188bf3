"""Benchmarks of fsdp against PyTorch FSDP2 (and Megatron-FSDP on CUDA).

Run ``uv run python -m benchmarks.compare``; results go to ``benchmarks/results/``.
"""
