"""The public gRPC API (proto/api.proto) that internal services call on the router."""
