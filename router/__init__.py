"""The Stratus router (edge gateway)."""
