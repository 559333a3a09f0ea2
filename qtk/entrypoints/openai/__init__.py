"""`qtk serve`: the OpenAI-compatible HTTP API over AsyncLLM.

Modules: api_server (the FastAPI app and its handlers), protocol (the request bodies, checked at
the edge), chat_choices (a chat completion's message or delta: content, reasoning, tool calls),
tool_calls and reasoning (the parsers of a model's text), metrics (/metrics, Prometheus),
request_log (--log-requests). The server talks to the engine through AsyncLLM's public methods only.
"""
