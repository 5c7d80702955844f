"""Faults of the clients: holder processes killed (-9), stopped (SIGSTOP), disconnected."""
