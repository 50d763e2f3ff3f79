"""The APIs the router serves. Each module turns its wire format into validated core requests
(router.core.generation) and the core's events into its wire format, and has `register(app)`; router.app
lists them. Nothing outside this package imports it but router.app."""
