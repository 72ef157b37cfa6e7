"""The OpenAI-compatible HTTP server (`pagedllm serve`): FastAPI routes in
front of one thread that steps the engine. Needs the `server` extra."""
