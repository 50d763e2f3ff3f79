"""HTTP API families; each module converts its wire format to the router's internal types."""
from aiohttp import web

# the RouterState of the running app (typed as object: api modules must not import router.app)
STATE = web.AppKey("state", object)
