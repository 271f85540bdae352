"""The OpenAI-compatible API (/v1/completions, /v1/chat/completions): its server, requests and replies."""
