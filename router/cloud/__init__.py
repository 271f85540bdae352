"""The cloud tier as the router reaches it: a link per gateway, the pool over them, the breaker, and
what the cloud serves (its catalog and models)."""
