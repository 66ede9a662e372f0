"""The checkpoint side: the sparse_attention_config block, its resolution and config.json I/O (no vLLM)."""
