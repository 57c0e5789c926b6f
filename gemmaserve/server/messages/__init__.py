"""Anthropic's Messages API over the chat pipeline: POST /v1/messages and /v1/messages/count_tokens.

    protocol.py   the request bodies (pydantic, strict, as protocol.py's OpenAI ones)
    translate.py  a Messages request -> the ChatRequest the chat endpoint prepares (system, blocks, tools, thinking)
    stream.py     the output parser's events (server/output_parser.py) -> Anthropic's server-sent events
    errors.py     errors in Anthropic's shape on these routes
    serving.py    the handlers: translate, reuse ChatServing.prepare/start and ChatJob.read, shape the answer
"""
