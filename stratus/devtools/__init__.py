"""Harness for the demo, tests and benchmarks: starting real Stratus processes on loopback
(``launcher``) and a user-space link emulator (``netem``). No server imports it."""
