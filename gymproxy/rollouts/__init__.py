"""Rollout capture: every model call of a rollout recorded with the exact tokens vLLM sampled
(`record`), kept in a store (`sqlite_store`, `redis_store`), rebuilt into trajectories
(`trajectory`) and exported for training (`export`)."""
