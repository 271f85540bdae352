"""Every gRPC server and channel Stratus runs: the one inference servicer and its data plane
interface (``servicer``), server and channel construction with Stratus's limits and TLS
(``channels``), the error interceptor, health, credentials (``auth``) and discovery."""
