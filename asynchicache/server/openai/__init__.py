"""server.openai."""
