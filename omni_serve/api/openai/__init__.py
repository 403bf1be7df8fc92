"""OpenAI-compatible request models and response builders."""
