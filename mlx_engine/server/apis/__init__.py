"""The wire formats: OpenAI chat and completions, Responses, embeddings, Anthropic Messages, and the server's own model and draft endpoints."""
