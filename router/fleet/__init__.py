"""The agents this router holds: the registry, each agent's handle, the index of who serves what, the
Hello's checks and the families' descriptions."""
