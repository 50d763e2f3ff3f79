"""HTTP plumbing every route shares.

HTTP plumbing every route shares: middlewares, the connection guards, reading a JSON body,
Server-Sent Events, and the OpenAPI document's building blocks.
"""
