"""The Stratus cloud gateway (escalation API)."""
