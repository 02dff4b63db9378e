"""AgentX-style benchmark: multi-turn agent sessions (growing shared prefixes, think time,
concurrency = live sessions) replayed closed-loop over the OpenAI HTTP API. See __main__.py."""
