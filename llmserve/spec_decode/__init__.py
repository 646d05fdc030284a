"""Speculative decoding: guess a request's next tokens cheaply, check them in the step's forward pass."""
