"""Generated gRPC stubs (``make proto``); nothing else lives here and nothing here is edited."""
