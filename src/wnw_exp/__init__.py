"""wnw-exp: audio KV-cache management experiments for long-form speech LLMs."""

__version__ = "0.1.0"
