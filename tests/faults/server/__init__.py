"""Faults of the Redis server: killed, stopped, restarted empty, failed over, slowed."""
