"""OpenAI's Responses API (/v1/responses): request models, the translation to chat, output items and stream
events, the store of responses, and the endpoint."""
