"""The OpenAI-compatible HTTP server: ``build_app`` (FastAPI) and ``serve`` (uvicorn)."""
