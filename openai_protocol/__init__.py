"""The OpenAI wire format every entry point shares: batch input lines, result lines, response bodies, the request-field rule."""
