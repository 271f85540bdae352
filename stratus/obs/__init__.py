"""Observability: Prometheus metrics (with null recorders when they are off), the moving
latency estimates every component predicts with, and the Parquet capture of audited and
escalated items."""
