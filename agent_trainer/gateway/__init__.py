"""An OpenAI-compatible gateway: a user's agent calls the policy through its own ``openai`` client.

``app`` serves the chat-completions API per session, ``sessions`` records every call as ids and builds the
training rows, ``server`` runs the app on 127.0.0.1 in a thread. See docs/gateway.md.
"""
