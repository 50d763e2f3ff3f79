"""tgi-py's router: the HTTP (and public gRPC) server in front of the shards."""

VERSION = "0.1.0"
