"""The OpenAI-compatible HTTP server: `python -m minisgl.server`. See docs/server.md."""
