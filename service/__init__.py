"""kvpool: a standalone paged KV-cache manager for LLM serving."""

__version__ = "0.1.0"
