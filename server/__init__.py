"""Online serving: model registry, block-masked runner, engine, OpenAI-compatible API, metrics."""
