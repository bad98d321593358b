"""What replicas share, and who may use them (floor 2 of docs/architecture.md): shared_state.py (Redis, or this
process), auth.py (API keys, tokens, origins, per-key limits), keys.py (`python -m agent_server.fleet.keys`),
agent_check.py (HAProxy's agent check), phrase_cache.py (audio of repeated segments, local and in Redis),
replica_metrics.py. It knows neither text/ nor audio/."""
