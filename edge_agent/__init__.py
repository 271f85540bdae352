"""The Stratus edge agent and on-device SDK."""
