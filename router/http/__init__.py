"""HTTP plumbing every route shares.

Middlewares, the connection guards, reading a JSON body, Server-Sent Events, and the OpenAPI
document's building blocks.
"""
