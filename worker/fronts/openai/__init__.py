"""OpenAI chat completions (and the model list) on the worker's router."""
