"""The HTTP side: the FastAPI app, its middleware, errors and metrics, the internal request
model and the one generation pipeline every API dialect (minisgl.api.dialects) runs through."""
