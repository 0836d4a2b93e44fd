"""The HTTP edge: OpenAI surface, classification, forwarding, metrics, stats, config and CLI."""

__version__ = "0.1.0"
