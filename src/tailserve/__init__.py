"""tailserve: an LLM serving system whose scheduler is the product."""

__version__ = "0.1.0"
