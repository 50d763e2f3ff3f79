"""The APIs the router serves, one package per family.

Each turns its wire format into validated core requests (router.core.generation) and the core's
events into its wire format, contributes its part of the OpenAPI document (openapi.py), and has
`register(app)`; router.app lists them. The families import only TGI's package (the base /generate
dialects build on); nothing outside api/ imports it but router.app.
"""
