"""OpenAI-compatible HTTP server: ``create_app`` builds it, ``pagedkv serve`` runs it."""

from pagedkv.server.app import create_app
from pagedkv.server.async_engine import AsyncEngine

__all__ = ["AsyncEngine", "create_app"]
