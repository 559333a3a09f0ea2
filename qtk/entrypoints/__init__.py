"""The ways into qtk's engine from outside Python: openai (`qtk serve`, the OpenAI-compatible HTTP API)."""
