"""The OpenAI-compatible HTTP server (`gemmaserve serve`): `app` (routes), `async_engine` (the engine on
its own thread), `protocol` (request validation, response shapes), `chat` (messages -> prompt),
`metrics` (Prometheus), `background` (the server on a thread, for tests and benchmarks)."""
