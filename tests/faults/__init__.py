"""Fault tests: processes killed, stopped, restarted, disconnected, or cut off the network."""
